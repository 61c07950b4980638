// A checkpoint's tensors, read piece by piece: any rank of any layout fills its own elements of a tensor
// from whichever files hold them, and offline tools assemble whole tensors. Files are opened on first
// use; every entry's shape and checksum are verified the first time it is read, so a damaged piece is
// named and nothing is half-trusted. Both formats read alike (a whole tensor is a one-piece tensor).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "loom/core/safetensors.h"
#include "loom/spec/param_table.h"
#include "loom/train/checkpoint_manifest.h"
#include "loom/train/checkpoint_pieces.h"

namespace loom::train {

class CheckpointReader {
 public:
  // dir: a checkpoint folder (step-N); m: its manifest, which must outlive the reader.
  CheckpointReader(std::filesystem::path dir, const CheckpointManifest& m);

  bool holds(const std::string& param, TensorRole role) const;
  // The whole tensor's shape, as the manifest records it (empty when it does not).
  std::vector<int64_t> shape(const std::string& param) const;
  // Elements [global, global + n) of the whole tensor (row-major) into dst. Throws IoError naming the
  // file and the tensor when a piece is missing, damaged, or no piece holds an element.
  void read_global(const std::string& param, TensorRole role, int64_t global, int64_t n, float* dst);
  // Local elements [begin, end) of p as `table` lays it out (a tp shard, a pipeline stage's) into dst;
  // padding gets zeros.
  void read(const spec::ParamTable& table, const spec::ParamSpec& p, TensorRole role, int64_t begin, int64_t end,
            float* dst);
  // Every (tensor, role) of the manifest's params whose elements the pieces do not all cover, as
  // "name (role): element N of M is in no piece"; empty when the checkpoint is whole. Reads no file.
  std::vector<std::string> holes() const;
  // The whole tensor.
  std::vector<float> read_whole(const std::string& param, TensorRole role = TensorRole::Weight);

 private:
  static std::string key(const std::string& param, TensorRole role);
  const float* entry_data(size_t entry);

  std::filesystem::path dir_;
  const CheckpointManifest& m_;
  PieceIndex index_;
  std::unordered_map<std::string, std::vector<int64_t>> shapes_;
  std::unordered_map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_set<size_t> verified_;
};

}  // namespace loom::train
