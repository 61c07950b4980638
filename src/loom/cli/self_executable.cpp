#include <filesystem>

#include "loom/cli/commands.h"

namespace loom::cli {

std::string self_executable() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.string();
}

}  // namespace loom::cli
