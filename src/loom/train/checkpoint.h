// Checkpoints: everything a run needs to continue bitwise-identically -- fp32 master weights,
// AdamW moments and step, the schedule position, the data position and seed, the tokenizer and the
// resolved config -- as safetensors plus a JSON manifest with per-tensor checksums, global shapes and
// placements (the format sharded checkpoints extend).
//
// Two formats (checkpoint.format). Sharded (the default): every rank writes its own pieces of the state
// -- the elements it holds, each written by exactly one rank -- into model-rankNNNNN.safetensors and
// optimizer-rankNNNNN.safetensors, plus a part index; rank 0 merges the parts into manifest.json, which
// says for every piece where its elements sit in the whole tensor (train/checkpoint_pieces.h). No rank
// gathers anything, so a model too large for one rank saves, and any layout loads it back. Whole: the
// state gathered on rank 0 and written as whole tensors in model.safetensors / optimizer.safetensors
// (one rank alone writes the same files in either format).
//
// Saving is atomic: every rank writes into <dir>/.tmp-step-N-<run>/ and fsyncs its files; rank 0, once
// every rank's part is there, writes the manifest, fsyncs the folder, renames it to <dir>/step-N/, fsyncs
// <dir>, and only then moves <dir>/latest (itself replaced atomically). A crash, kill or full disk on any
// rank at any moment leaves the previous checkpoint intact and `latest` pointing at it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/core/safetensors.h"
#include "loom/train/checkpoint_pieces.h"
#include "loom/train/trainer.h"

namespace loom::train {

// What one save writes, taken from a trainer at a step boundary: its tensors (pointing into the
// trainer's gathered state, or into `owned`, a copy that outlives the step for an asynchronous write)
// and the facts of its manifest. Checksums are computed when it is written.
struct CheckpointImage {
  int64_t step = 0;
  // Sharded: this rank's part of the job's save (rank 0 also finishes the checkpoint); the files it
  // writes are model_file and optimizer_file.
  bool sharded = false;
  int rank = 0, ranks = 1;
  std::string model_file = "model.safetensors", optimizer_file = "optimizer.safetensors";
  std::vector<SafetensorsEntry> model, optimizer;
  nlohmann::json index = nlohmann::json::array();  // per tensor, in model / exp_avg / exp_avg_sq order
  nlohmann::json facts;                            // layout, optimizer, schedule, data, config
  std::string tokenizer_file, tokenizer_hash;
  Tensor owned;                                    // the copied state (asynchronous saves)
};

// The sharded format's file names for `rank` of `ranks` (one rank alone: model.safetensors, ...).
void name_shard_files(CheckpointImage& img, int rank, int ranks);
// Appends one piece of parameter p -- its weights and two moments, `data` each piece.end - piece.begin
// floats -- to a sharded image, keyed and indexed as every sharded save writes it. `seen` counts the
// pieces of each parameter already in the image (a second one gets the key "<name>@<first element>").
void add_piece(CheckpointImage& img, const spec::ParamSpec& p, const SavePiece& piece, const float* const data[3],
               std::unordered_map<std::string, int>& seen);

class CheckpointManager {
 public:
  // `resuming`: this process continues the run whose checkpoints are in `dir`. Without it, a dir
  // that already holds checkpoints is refused (it belongs to another run) -- nothing is overwritten.
  // rank / ranks: this process's place in the job (every rank of a sharded save has a manager; only
  // rank 0 cleans up, finishes saves and prunes).
  CheckpointManager(std::string dir, int64_t keep, bool resuming, int rank = 0, int ranks = 1);

  // Saves the trainer's state after `step` completed steps; returns the checkpoint's path. On
  // failure throws IoError saying what failed and that the previous checkpoint is intact.
  std::string save(Trainer& trainer, int64_t step);
  // save() in two halves. capture: the trainer's gathered state after `step` (rank 0, between
  // gather_full_state and release_full_state); with `copy_into` the tensors are copied into that buffer
  // (allocated from `alloc` as Workspace the first time, then reused: a fresh 100 MB buffer costs more
  // in page faults than the copy) so training may go on. write: the files, atomically as above; it
  // touches nothing of the trainer and may run on another thread, one write at a time.
  CheckpointImage capture(Trainer& trainer, int64_t step, Tensor* copy_into = nullptr, Allocator* alloc = nullptr) const;
  // The sharded format's capture, on every rank (no gather first): this rank's pieces of its weights and
  // moments (train/checkpoint_pieces.h's saved_ranges), copied like capture()'s when copy_into is given.
  CheckpointImage capture_shard(Trainer& trainer, int64_t step, Tensor* copy_into = nullptr,
                                Allocator* alloc = nullptr) const;
  // Sharded images: every rank writes its files and part index; rank 0 then waits (up to
  // comm::kSaveTimeout) for every rank's part, checks that the pieces cover every tensor, and finishes
  // the checkpoint. The others return once their part is on disk (the checkpoint is complete when rank
  // 0's write returns). A rank whose write fails says so in the folder, and rank 0's save fails naming it.
  std::string write(const CheckpointImage& image);
  // The checkpoint `latest` points at, if any.
  std::optional<std::string> latest() const;
  static std::optional<std::string> latest_in(const std::string& dir);

  const std::string& run_id() const { return run_id_; }
  // Every rank must use rank 0's run id (their temporary folder is named by it): set from a broadcast.
  void set_run_id(std::string id) { run_id_ = std::move(id); }
  const std::string& dir() const { return dir_; }

 private:
  void prune(const std::string& just_saved);
  std::string write_whole(const CheckpointImage& image);
  void write_part(const CheckpointImage& image, const std::string& tmp) const;
  // Rank 0: waits for every rank's part, merges them and checks coverage; returns the manifest's tensors.
  nlohmann::json merge_parts(const std::string& tmp, int ranks, const nlohmann::json& params) const;
  void fault_point(const char* phase) const;
  // The last steps of every save: the manifest into the folder, fsync, rename to step-N, `latest`.
  void publish(const std::string& tmp, const std::string& manifest, int64_t step) const;
  // The manifest's format, version, step, run and the image's facts.
  nlohmann::json manifest_head(const CheckpointImage& img) const;
  // The image's index with every entry's checksum.
  static nlohmann::json checksummed_index(const CheckpointImage& img);

  std::string dir_;
  int64_t keep_;
  int rank_ = 0, ranks_ = 1;
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
