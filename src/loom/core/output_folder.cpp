#include "loom/core/output_folder.h"

#include <unistd.h>

#include <climits>
#include <filesystem>
#include <system_error>

#include "loom/error.h"

namespace loom {

void check_output_folder(const std::string& dir, const std::string& what) {
  namespace fs = std::filesystem;
  const std::string fix = "; choose a " + what + " in a writable folder";
  const fs::path path = fs::absolute(fs::path(dir.empty() ? "." : dir)).lexically_normal();
  if (path.native().size() >= PATH_MAX)
    throw IoError(what + " '" + dir + "' is longer than the " + std::to_string(PATH_MAX) + " bytes a path may have" +
                  fix);
  for (const fs::path& part : path)
    if (part.native().size() > NAME_MAX)
      throw IoError(what + " '" + dir + "': the name '" + part.native().substr(0, 40) + "...' is longer than the " +
                    std::to_string(NAME_MAX) + " bytes a file name may have" + fix);
  // The nearest part of the path that exists must be a folder this process may write into.
  fs::path probe = path;
  for (;;) {
    std::error_code ec;
    const fs::file_status st = fs::status(probe, ec);
    if (!ec && fs::exists(st)) {
      if (!fs::is_directory(st)) throw IoError(what + " '" + dir + "': '" + probe.string() + "' is a file, not a folder" + fix);
      break;
    }
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      throw IoError(what + " '" + dir + "': cannot check '" + probe.string() + "' (" + ec.message() + ")" + fix);
    if (probe == probe.root_path() || !probe.has_parent_path()) break;
    probe = probe.parent_path();
  }
  if (::access(probe.c_str(), W_OK | X_OK) != 0)
    throw IoError(what + " '" + dir + "': the folder '" + probe.string() + "' is not writable" + fix);
}

}  // namespace loom
