// The typed run configuration: one struct per TOML table, each field documented once in the field
// registry (run_config.cpp), which drives parsing, `--set key=value` overrides, unknown-key errors
// and `loom train --help`.
#pragma once

#include <algorithm>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/model/parameter_store.h"
#include "loom/spec/recompute.h"
#include "loom/spec/transformer_config.h"

namespace loom::train {

struct ModelSection {
  std::string preset = "mini";
  spec::TransformerConfig resolved;  // the preset with every explicit [model] key applied
};

struct TrainSection {
  uint64_t seed = 1234;
  int64_t steps = 200;
  int64_t batch_size = 8;         // global batch, in sequences
  int64_t micro_batch_size = 0;   // 0: equal to batch_size (no accumulation)
  int64_t seq_len = 0;            // 0: model.max_seq
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 20;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;         // max global gradient norm; 0 disables clipping
  // Bad steps (train/bad_step_guard.h): a non-finite loss or gradient, or a loss spike (z-score over
  // the last loss_spike_window applied steps above loss_spike_zscore; 0: off), is not applied; more
  // than max_consecutive_skips of them in a row stop the run (0: the first one does).
  int64_t max_consecutive_skips = 3;
  double loss_spike_zscore = 0;
  int64_t loss_spike_window = 50;
  // What backward computes again instead of keeping it from forward (spec/recompute.h).
  spec::Recompute recompute = spec::Recompute::None;
  int64_t eval_every = 50;        // steps between validation losses; 0 disables
  int64_t eval_batches = 4;
  int64_t log_every = 1;
  int threads = 0;                // 0: all cores (LOOM_THREADS overrides)
  std::string out_dir = "runs/latest";
};

struct DataSection {
  std::string source = "synthetic";  // "synthetic" or "shards"
  std::string dir = "data/fortunes";  // shard folder written by `loom prepare` (source = "shards")
};

// precision = "fp8" (model/fp8_recipe.h). The issue's `precision.fp8.recipe` is spelt fp8.recipe: TOML
// cannot make `precision` both a string and a table.
struct Fp8Section {
  std::string recipe = "delayed";    // delayed | current | blockwise
  int64_t amax_history = 16;         // delayed: steps of amax history per tensor
  std::string grad_format = "e5m2";  // output gradients: e5m2 | e4m3
  int64_t margin = 0;                // delayed / current: scales lowered by 2^margin
};

struct CheckpointSection {
  std::string dir = "checkpoints";
  int64_t save_every = 0;  // 0: no periodic checkpoints (SIGTERM still saves one)
  int64_t keep = 0;        // 0: keep all; else prune this run's older checkpoints beyond the newest K
  bool async = false;      // each writing rank copies its state and writes it on a background thread
  // "sharded": every rank writes its own pieces and rank 0 the index (no rank gathers the model);
  // "whole": the state is gathered to rank 0 and written as whole tensors (one model.safetensors).
  std::string format = "sharded";
};

struct TraceSection {
  std::string file;      // Chrome trace JSON; empty: no event trace
  bool summary = true;   // print time per kernel at the end
};

struct ParallelSection {
  int64_t dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  std::string cp_mode = "ring";    // with cp: "ring" or "all-to-all" (spec/context_parallel.h)
  bool sequence_parallel = false;  // with tp: norm / residual regions sharded along the token rows
  bool tp_overlap = true;          // with tp: weight-gradient GEMMs under the input-gradient collectives
  std::string pipeline_schedule = "1f1b";  // with pp: gpipe | 1f1b | interleaved-1f1b | zb-h1
  int64_t pipeline_virtual_stages = 1;     // chunks per pipeline rank (interleaved-1f1b: >= 2)
  std::string pipeline_layers;             // blocks per chunk, "7,8,8,7" (empty: balanced by cost)
  bool pipeline_bf16_transfers = true;     // bf16 runs: stage-to-stage transfers in bf16
  int64_t zero = 0;
  int64_t bucket_kb = 4096;  // data-parallel gradient bucket; 0: one all-reduce after backward
  std::string zero_release = "lazy";  // how ZeRO-2/3 give pages back: "lazy" (MADV_FREE) or "eager"
};

struct RunConfig {
  ModelSection model;
  TrainSection train;
  // The GEMMs' dtype: FP32 for "fp32", BF16 for every other mode.
  model::Precision precision = model::Precision::FP32;
  // precision = "bf16-sr": bf16 with the weights' bf16 copies rounded stochastically after each update
  // (model::ParameterStore::use_stochastic_rounding). Also true under "bf16-pure".
  bool stochastic_rounding = false;
  // precision = "bf16-pure": parameters and AdamW moments stored in bf16 only (no f32 master), every
  // update rounded stochastically (model::ParameterStore's pure storage, AdamW's bf16 state).
  bool pure_bf16 = false;
  // precision = "fp8": bf16 with f32 masters whose blocks' linears quantise their GEMM inputs to fp8
  // (emulated) under fp8.recipe.
  bool fp8 = false;
  Fp8Section fp8_options;
  std::string precision_label() const {
    return fp8 ? "fp8" : pure_bf16 ? "bf16-pure" : stochastic_rounding ? "bf16-sr" : model::precision_name(precision);
  }
  DataSection data;
  CheckpointSection checkpoint;
  TraceSection trace;
  ParallelSection parallel;

  int64_t seq_len() const { return train.seq_len > 0 ? train.seq_len : model.resolved.max_seq; }
  // 0 means one micro-batch per step: the whole batch, or with data parallelism each rank's share.
  int64_t micro_batch() const {
    return train.micro_batch_size > 0 ? train.micro_batch_size : train.batch_size / std::max<int64_t>(parallel.dp, 1);
  }
  // Throws ConfigError on values that cannot run (batch not divisible, parallel degrees not yet
  // supported, ...), naming the keys and numbers.
  void validate() const;
  // The resolved configuration as TOML (written into the run manifest; loadable again).
  std::string to_toml() const;
  // Every key with its value as a TOML literal, in the registry's order.
  std::vector<std::pair<std::string, std::string>> key_values() const;
};

// Parses TOML text, then applies `key=value` overrides in order. `origin` names the text in errors.
RunConfig parse_run_config(const std::string& toml_text, const std::string& origin,
                           const std::vector<std::string>& overrides = {});
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Every key with its type, range, default and one line of documentation, for --help.
std::string config_reference();

// The registry as data (for tests and tools): each key, its type, and for numbers the accepted range.
struct ConfigKeyInfo {
  std::string key, type;
  bool numeric = false;
  double lo = 0, hi = 0;
  bool lo_open = false, hi_open = false;
};
std::vector<ConfigKeyInfo> config_keys();

}  // namespace loom::train
