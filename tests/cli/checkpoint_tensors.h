// Whole tensors of a checkpoint of any format and layout, assembled from its pieces (checksums
// verified): what the tests compare between runs saved under different layouts.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "loom/train/checkpoint_manifest.h"
#include "loom/train/checkpoint_reader.h"

namespace loom::test {

inline std::map<std::string, std::vector<float>> checkpoint_tensors(
    const std::filesystem::path& dir, train::TensorRole role = train::TensorRole::Weight) {
  const auto m = train::read_checkpoint_manifest(dir.string());
  train::CheckpointReader reader(dir, m);
  std::map<std::string, std::vector<float>> out;
  for (const auto& p : m.params) out[p.name] = reader.read_whole(p.name, role);
  return out;
}

}  // namespace loom::test
