// The manifest.json of a checkpoint (train/checkpoint.cpp writes it): what resuming, `loom generate`
// and `loom export` read back, parsed and checked in one place, so a damaged or foreign file is refused
// with one line naming the file and the field instead of failing somewhere later.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom::train {

inline constexpr const char* kCheckpointFormat = "loom-checkpoint";
inline constexpr int kCheckpointVersion = 1;

struct CheckpointTensorEntry {
  std::string name;      // the key in its safetensors file
  std::string param;     // the parameter it belongs to (the weight itself or one of its AdamW moments)
  bool model = true;     // in model.safetensors; false: optimizer.safetensors
  std::string checksum;  // checksum_hex of the tensor's bytes
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
};

// Parses and checks a manifest's text; `origin` names it in errors. Throws IoError naming the file and
// what is wrong. The version is read, not judged: callers that need a given version compare it.
CheckpointManifest parse_checkpoint_manifest(const std::string& text, const std::string& origin);
// Reads <dir>/manifest.json and parses it. Throws IoError.
CheckpointManifest read_checkpoint_manifest(const std::string& dir);

}  // namespace loom::train
