#include "loom/core/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/core/file_writer.h"
#include "loom/error.h"

namespace loom {

namespace {
DType dtype_from_name(const std::string& s, const std::string& where) {
  for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64, DType::F64})
    if (dtype_name(t) == s) return t;
  throw IoError(where + ": unsupported dtype '" + s + "' (Loom reads F32, BF16, I32, I64, F64)");
}
}  // namespace

void write_safetensors(const std::string& path, std::vector<SafetensorsEntry> tensors,
                       const std::map<std::string, std::string>& metadata, const SafetensorsWriteOptions& options) {
  std::sort(tensors.begin(), tensors.end(), [](auto& a, auto& b) { return a.name < b.name; });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (auto& t : tensors) {
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    if (static_cast<size_t>(n) * dtype_size(t.dtype) != t.nbytes)
      throw ShapeError("safetensors: tensor '" + t.name + "' has " + std::to_string(t.nbytes) +
                       " bytes, which does not match its shape and dtype");
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  FileWriter out(path);
  uint64_t len = h.size();
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
  out.write(le, 8);
  out.write(h.data(), h.size());
  constexpr size_t kChunk = size_t{4} << 20;
  uint64_t data_written = 0;
  for (auto& t : tensors) {
    const char* p = static_cast<const char*>(t.data);
    for (size_t off = 0; off < t.nbytes; off += kChunk) {
      size_t n = std::min(kChunk, t.nbytes - off);
      out.write(p + off, n);
      data_written += n;
      if (options.on_progress) options.on_progress(data_written);
    }
  }
  if (options.sync) out.sync();
  out.close();
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot open '" + path + "'");
  bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  parse();
}

SafetensorsFile::SafetensorsFile(std::vector<char> bytes, std::string origin)
    : path_(std::move(origin)), bytes_(std::move(bytes)) {
  parse();
}

void SafetensorsFile::parse() {
  const std::string& path = path_;
  if (bytes_.size() < 8) throw IoError(path + ": not a safetensors file (shorter than its 8-byte header length)");
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[i])) << (8 * i);
  if (len > bytes_.size() - 8) throw IoError(path + ": header length " + std::to_string(len) + " exceeds the file size");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes_.begin() + 8, bytes_.begin() + 8 + static_cast<ptrdiff_t>(len));
  } catch (const nlohmann::json::exception& e) {
    throw IoError(path + ": malformed safetensors header: " + e.what());
  }
  if (!header.is_object()) throw IoError(path + ": safetensors header is not a JSON object");
  const size_t data_start = 8 + len, data_size = bytes_.size() - data_start;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw IoError(path + ": __metadata__ is not an object");
      for (auto& [k, mv] : v.items())
        if (mv.is_string()) metadata_[k] = mv.get<std::string>();
      continue;
    }
    std::string where = path + ": tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      throw IoError(where + " lacks dtype, shape or data_offsets");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype_from_name(v["dtype"].get<std::string>(), where);
    // Element count and byte size checked for overflow: a shape whose product wraps could otherwise
    // match a small byte range and pass as a tensor far larger than its data.
    uint64_t n = 1, bytes = 0;
    for (auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) throw IoError(where + " has an invalid shape");
      e.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(e.shape.back()), &n))
        throw IoError(where + " has a shape " + v["shape"].dump() + " whose element count overflows 64 bits");
    }
    if (__builtin_mul_overflow(n, dtype_size(e.dtype), &bytes))
      throw IoError(where + " has a shape " + v["shape"].dump() + " whose byte size overflows 64 bits");
    auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) throw IoError(where + " has invalid data_offsets");
    uint64_t b = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (b > end || end > data_size)
      throw IoError(where + " has data_offsets [" + std::to_string(b) + ", " + std::to_string(end) +
                    ") beyond the data section of " + std::to_string(data_size) + " bytes (truncated file?)");
    if (end - b != bytes)
      throw IoError(where + " holds " + std::to_string(end - b) + " bytes, but its shape and dtype need " +
                    std::to_string(bytes));
    e.data = bytes_.data() + data_start + b;
    e.nbytes = end - b;
    entries_.push_back(std::move(e));
  }
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(entries_.begin(), entries_.end(), [&](auto& e) { return e.name == name; });
}

const SafetensorsEntry& SafetensorsFile::at(const std::string& name) const {
  for (auto& e : entries_)
    if (e.name == name) return e;
  throw IoError(path_ + ": no tensor named '" + name + "'");
}

}  // namespace loom
