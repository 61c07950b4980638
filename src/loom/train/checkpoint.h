// Checkpoints: everything a run needs to continue bitwise-identically -- fp32 master weights,
// AdamW moments and step, the schedule position, the data position and seed, the tokenizer and the
// resolved config -- as safetensors plus a JSON manifest with per-tensor checksums, global shapes and
// placements (the format sharded checkpoints extend).
//
// Saving is atomic: write into <dir>/.tmp-step-N-<pid>/, fsync every file and the folder, rename to
// <dir>/step-N/, fsync <dir>, and only then move <dir>/latest (itself replaced atomically). A crash,
// kill or full disk at any moment leaves the previous checkpoint intact and `latest` pointing at it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/core/safetensors.h"
#include "loom/train/trainer.h"

namespace loom::train {

// What one save writes, taken from a trainer at a step boundary: its tensors (pointing into the
// trainer's gathered state, or into `owned`, a copy that outlives the step for an asynchronous write)
// and the facts of its manifest. Checksums are computed when it is written.
struct CheckpointImage {
  int64_t step = 0;
  std::vector<SafetensorsEntry> model, optimizer;
  nlohmann::json index = nlohmann::json::array();  // per tensor, in model / exp_avg / exp_avg_sq order
  nlohmann::json facts;                            // layout, optimizer, schedule, data, config
  std::string tokenizer_file, tokenizer_hash;
  Tensor owned;                                    // the copied state (asynchronous saves)
};

class CheckpointManager {
 public:
  // `resuming`: this process continues the run whose checkpoints are in `dir`. Without it, a dir
  // that already holds checkpoints is refused (it belongs to another run) -- nothing is overwritten.
  CheckpointManager(std::string dir, int64_t keep, bool resuming);

  // Saves the trainer's state after `step` completed steps; returns the checkpoint's path. On
  // failure throws IoError saying what failed and that the previous checkpoint is intact.
  std::string save(Trainer& trainer, int64_t step);
  // save() in two halves. capture: the trainer's gathered state after `step` (rank 0, between
  // gather_full_state and release_full_state); with `copy_into` the tensors are copied into that buffer
  // (allocated from `alloc` as Workspace the first time, then reused: a fresh 100 MB buffer costs more
  // in page faults than the copy) so training may go on. write: the files, atomically as above; it
  // touches nothing of the trainer and may run on another thread, one write at a time.
  CheckpointImage capture(Trainer& trainer, int64_t step, Tensor* copy_into = nullptr, Allocator* alloc = nullptr) const;
  std::string write(const CheckpointImage& image);
  // The checkpoint `latest` points at, if any.
  std::optional<std::string> latest() const;
  static std::optional<std::string> latest_in(const std::string& dir);

  const std::string& run_id() const { return run_id_; }
  const std::string& dir() const { return dir_; }

 private:
  void prune(const std::string& just_saved);

  std::string dir_;
  int64_t keep_;
  std::string run_id_;
};

// The newest complete checkpoint in `dir`: the highest step-N folder whose manifest reads (a folder
// exists only once its save was whole), of the run `latest` names when it names one. A crash between a
// save's rename and its `latest` update leaves that newer folder, which this finds.
std::optional<std::string> newest_complete_checkpoint(const std::string& dir);

struct ResumeReport {
  int64_t step = 0;
  // Config keys whose value differs from the checkpoint's in ways that still load (e.g. train.steps);
  // the run continues, but is no longer bitwise the original one.
  std::vector<std::string> changed_keys;
};

// Loads a checkpoint (a step-N folder, or a checkpoint dir whose `latest` is followed) into a freshly
// constructed trainer: verifies every tensor's checksum, refuses a different model, layout or
// tokenizer with one line naming the difference, restores weights, moments and step.
ResumeReport load_checkpoint(const std::string& path, Trainer& trainer);

// The checkpoint folder `path` names: itself if it holds a manifest, else <path>/<latest>.
std::string resolve_checkpoint(const std::string& path);

// For inference and export: the resolved config a checkpoint was trained with, its tokenizer model
// file ("" when trained on synthetic data), and its master weights (checksums verified) loaded into
// a ParameterStore built from that config.
RunConfig checkpoint_config(const std::string& path);
std::string checkpoint_tokenizer(const std::string& path);
void load_model_weights(const std::string& path, model::ParameterStore& params);

}  // namespace loom::train
