#include "loom/core/output_folder.h"

#include <unistd.h>

#include <climits>
#include <filesystem>
#include <system_error>

#include "loom/error.h"

namespace loom {

namespace {

// `shown` is the path the user gave (the folder itself, or a file in it), named in every message.
void check_folder(const std::string& dir, const std::string& shown, const std::string& what) {
  namespace fs = std::filesystem;
  const std::string fix = "; choose a " + what + " in a writable folder";
  const fs::path path = fs::absolute(fs::path(dir.empty() ? "." : dir)).lexically_normal();
  if (path.native().size() >= PATH_MAX)
    throw IoError(what + " '" + shown + "' is longer than the " + std::to_string(PATH_MAX) + " bytes a path may have" +
                  fix);
  for (const fs::path& part : path)
    if (part.native().size() > NAME_MAX)
      throw IoError(what + " '" + shown + "': the name '" + part.native().substr(0, 40) + "...' is longer than the " +
                    std::to_string(NAME_MAX) + " bytes a file name may have" + fix);
  // The nearest part of the path that exists must be a folder this process may write into.
  fs::path probe = path;
  for (;;) {
    std::error_code ec;
    const fs::file_status st = fs::status(probe, ec);
    if (!ec && fs::exists(st)) {
      if (!fs::is_directory(st)) throw IoError(what + " '" + shown + "': '" + probe.string() + "' is a file, not a folder" + fix);
      break;
    }
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      throw IoError(what + " '" + shown + "': cannot check '" + probe.string() + "' (" + ec.message() + ")" + fix);
    if (probe == probe.root_path() || !probe.has_parent_path()) break;
    probe = probe.parent_path();
  }
  if (::access(probe.c_str(), W_OK | X_OK) != 0)
    throw IoError(what + " '" + shown + "': the folder '" + probe.string() + "' is not writable" + fix);
}

}  // namespace

void check_output_folder(const std::string& dir, const std::string& what) { check_folder(dir, dir, what); }

void check_output_file(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const std::string fix = "; choose a " + what + " in a writable folder";
  if (path.empty() || file.filename().empty()) throw IoError(what + " '" + path + "' names no file" + fix);
  check_folder(file.has_parent_path() ? file.parent_path().string() : ".", path, what);
  std::error_code ec;
  const fs::file_status st = fs::status(file, ec);
  if (fs::is_directory(st)) throw IoError(what + " '" + path + "' is a folder, not a file" + fix);
  if (fs::exists(st) && ::access(file.c_str(), W_OK) != 0) throw IoError(what + " '" + path + "' is read-only" + fix);
}

}  // namespace loom
