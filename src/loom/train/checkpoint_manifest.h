// The manifest.json of a checkpoint (train/checkpoint.cpp writes it): what resuming, `loom generate`
// and `loom export` read back, parsed and checked in one place, so a damaged or foreign file is refused
// with one line naming the file and the field instead of failing somewhere later.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/train/checkpoint_pieces.h"

namespace loom::train {

inline constexpr const char* kCheckpointFormat = "loom-checkpoint";
// 1: whole tensors in model.safetensors and optimizer.safetensors. 2: pieces, each rank's in its own files,
// every entry saying where its elements sit in the whole tensor (whole tensors are the one-piece case).
inline constexpr int kCheckpointVersion = 2;
inline constexpr int kOldestCheckpointVersion = 1;

// What an entry holds of its parameter: the master weights or one of the AdamW moments.
enum class TensorRole { Weight, ExpAvg, ExpAvgSq };
const char* role_name(TensorRole role);

struct CheckpointTensorEntry {
  std::string name;      // the key in its safetensors file
  std::string param;     // the parameter it belongs to (the weight itself or one of its AdamW moments)
  std::string file;      // the safetensors file in the checkpoint folder holding it
  TensorRole role = TensorRole::Weight;
  std::string checksum;  // checksum_hex of the tensor's bytes
  // Where its elements sit in the whole tensor; empty: it is the whole tensor.
  std::vector<PieceRun> runs;
  bool model() const { return role == TensorRole::Weight; }
};

struct CheckpointParam {
  std::string name;
  std::vector<int64_t> shape;  // the whole tensor's
  std::string placement;       // as trained ("" when the manifest does not say)
};

struct CheckpointTokenizer {
  std::string file;  // a name inside the checkpoint folder
  std::string hash;
};

struct CheckpointManifest {
  int64_t version = kCheckpointVersion;
  int64_t step = 0;
  std::string run_id;  // "" when absent
  int64_t optimizer_steps = 0;
  std::optional<CheckpointTokenizer> tokenizer;  // absent when trained on synthetic data
  std::string config_toml;                       // the resolved run configuration
  std::vector<CheckpointTensorEntry> tensors;
  std::vector<CheckpointParam> params;  // every parameter the checkpoint holds, whole shapes
  int64_t ranks = 1;                    // how many ranks wrote it (files)
  // precision = "fp8": each quantised tensor's amax history (oldest first), by name; empty otherwise.
  std::vector<std::pair<std::string, std::vector<float>>> fp8_amax_history;
};

// Parses and checks a manifest's text; `origin` names it in errors. Throws IoError naming the file and
// what is wrong. The version is read, not judged: callers that need a given version compare it.
CheckpointManifest parse_checkpoint_manifest(const std::string& text, const std::string& origin);
// Reads <dir>/manifest.json and parses it. Throws IoError.
CheckpointManifest read_checkpoint_manifest(const std::string& dir);

}  // namespace loom::train
