// safetensors files (Hugging Face's format): an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then raw little-endian tensor bytes.
// Used for checkpoints, Hugging Face interchange and PyTorch parity tests. Reading validates every
// offset against the file size before touching data, so a truncated or hostile file is refused
// with a message naming the tensor, never read out of bounds.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loom/core/dtype.h"

namespace loom {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // for writing: the bytes; for reading: points into SafetensorsFile
  size_t nbytes = 0;
};

struct SafetensorsWriteOptions {
  bool sync = false;  // fsync before returning (checkpoints)
  // Called after each chunk of tensor data with the bytes written so far (progress, fault injection).
  std::function<void(uint64_t)> on_progress;
};

// Writes tensors sorted by name. Throws IoError naming the path on failure (disk full included).
void write_safetensors(const std::string& path, std::vector<SafetensorsEntry> tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       const SafetensorsWriteOptions& options = {});

class SafetensorsFile {
 public:
  // Reads and validates the whole file. Throws IoError naming the file and the bad entry.
  explicit SafetensorsFile(const std::string& path);
  // The same checks over a file's bytes already in memory; `origin` names them in errors.
  SafetensorsFile(std::vector<char> bytes, std::string origin);
  const std::vector<SafetensorsEntry>& tensors() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Throws IoError if absent.
  const SafetensorsEntry& at(const std::string& name) const;
  bool contains(const std::string& name) const;

 private:
  void parse();

  std::string path_;
  std::vector<char> bytes_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace loom
