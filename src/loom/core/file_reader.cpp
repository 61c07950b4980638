#include "loom/core/file_reader.h"

#include <fstream>

#include "loom/error.h"

namespace loom {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot read '" + path.string() + "': check that it exists and is readable");
  std::string s;
  in.seekg(0, std::ios::end);
  const auto size = in.tellg();
  in.seekg(0, std::ios::beg);
  if (size > 0) s.resize(static_cast<size_t>(size));
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  if (!in && !in.eof()) throw IoError("error while reading '" + path.string() + "'");
  s.resize(static_cast<size_t>(in.gcount()));
  return s;
}

}  // namespace loom
