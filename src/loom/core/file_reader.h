// Reading a whole file into memory (configs, manifests, hardware files, corpus text): one place that
// names the file in its error.
#pragma once

#include <filesystem>
#include <string>

namespace loom {

// Throws IoError naming the path when it cannot be opened or read.
std::string read_file(const std::filesystem::path& path);

}  // namespace loom
