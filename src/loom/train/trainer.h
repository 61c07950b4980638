// The training loop: micro-batches with gradient accumulation, data parallelism, global-norm clipping,
// AdamW on fp32 masters, warm-up + cosine LR, periodic validation, and a hard stop naming the step
// and tensor when a loss or gradient goes non-finite. Reports each step through a callback; never
// prints.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/parallelize.h"
#include "loom/model/fp8_recipe.h"
#include "loom/model/transformer.h"
#include "loom/train/adamw.h"
#include "loom/train/bad_step_guard.h"
#include "loom/train/lr_schedule.h"
#include "loom/train/pipeline_executor.h"
#include "loom/train/run_config.h"
#include "loom/train/step_hooks.h"
#include "loom/train/token_source.h"

namespace loom::train {

// One mixture-of-experts block's routing over a step, summed over the ranks.
struct MoeBlockLoad {
  int64_t layer = 0;
  std::vector<int64_t> routed;  // (token, slot) pairs routed to each expert, before capacity
  int64_t dropped = 0;          // pairs past their expert's capacity
  double imbalance = 0;         // the busiest expert's pairs over the mean
  double aux_loss = 0;          // the load-balancing loss, mean over micro-batches and replicas
};

struct StepMetrics {
  int64_t step = 0, total_steps = 0;
  double loss = 0;
  std::optional<double> val_loss;
  double lr = 0, grad_norm = 0;
  // Not applied (train/bad_step_guard.h): no update was made, for skip_reason. skipped_steps counts
  // this run's skipped steps so far.
  bool skipped = false;
  std::string skip_reason;
  int64_t skipped_steps = 0;
  double step_seconds = 0, tokens_per_s = 0;
  double mfu = 0;  // model FLOPs / s over the device peak; 0 when the peak is unknown
  double elapsed_seconds = 0;
  int64_t tokens = 0;  // tokens processed so far
  // Data parallelism: wall time this rank's training thread spent waiting for gradient / parameter
  // collectives (communication no computation overlapped), and CPU time the dp group's communication
  // used (overlapped or not: on a CPU it takes cycles from compute either way). 0 on one rank.
  double exposed_comm_seconds = 0;
  double comm_cpu_seconds = 0;
  // Pipeline parallelism: each stage's idle fraction of this step's schedule (the time it waited on
  // pipeline transfers over the schedule's wall time: the bubble plus exposed transfers), indexed by
  // pipeline rank, and the schedule's theoretical bubble. Empty without pp.
  std::vector<double> pipeline_idle;
  double pipeline_bubble_theory = 0;
  // precision = "fp8": elements that saturated (overflow) or became zero (underflow) when this step's
  // GEMM inputs were quantised, summed over the ranks, in all and per tensor (those with any).
  bool fp8 = false;
  int64_t fp8_overflow = 0, fp8_underflow = 0;
  std::vector<model::Fp8TensorCounts> fp8_tensors;
  // Mixture of experts: each MoE block's load (empty for a dense model).
  std::vector<MoeBlockLoad> moe;
};

class Trainer {
 public:
  // peak_flops: one rank's device peak, which MFU is measured against (0: MFU not reported).
  // par: what parallel::parallelize built for this rank (nullptr: this rank trains the whole model
  // alone). Each dp rank runs its share of every batch's samples; gradients are summed across the
  // group after backward, so every replica takes the same step. The tp ranks of a replica run the same
  // samples, each on its shard of the weights. Not owned; outlives the trainer.
  Trainer(const RunConfig& cfg, kernels::Backend& backend, double peak_flops,
          const parallel::Parallelism* par = nullptr);

  // Runs one optimizer step (step counts from 1).
  StepMetrics train_step(int64_t step);
  // Mean loss over the first eval_batches() x train.batch_size validation samples (the same set
  // under every layout and micro-batch size).
  double evaluate();
  // train.eval_batches, at most the whole batches in one pass over the validation split (at least
  // one): past that a validation would only go round the same samples again (a million batches of a
  // 44-window split ran for hours).
  int64_t eval_batches() const;
  // Data parallelism: hashes this replica's weights and optimizer state, compares the hashes across the
  // dp group and throws NumericError naming the first rank that differs from dp rank 0 (replicas
  // must stay bitwise identical). Collective over the dp group; a no-op alone.
  void check_replicas(int64_t step);

  // Optimizer moments of the whole arena, as a checkpoint stores them. Under ZeRO each rank holds its
  // pieces: gather_full_state() (collective over the dp group: every rank calls it before dp rank 0
  // saves) assembles the full moments, and under ZeRO-3 the full weights, on dp rank 0 (the others
  // send their pieces); release_full_state() gives that memory back.
  //
  // Under tensor parallelism gather_full_state() then also assembles the whole tensors from every tp
  // shard on global rank 0 (laid out by the whole model's table), so a checkpoint holds full Hugging
  // Face tensors whatever the layout. full_table(), full_master() and full_moments() are what a save
  // writes: this rank's own state where nothing is sharded.
  using Moments = parallel::DataParallel::Moments;
  Moments full_moments() const;
  const spec::ParamTable& full_table() const;
  const float* full_master() const;
  void gather_full_state();
  void release_full_state();
  // The arena ranges whose weights this rank holds at rest: its pieces under ZeRO-3, else all (empty).
  std::vector<spec::ArenaRange> weights_held() const;
  // After weights were written from outside (a checkpoint, an import): refreshes the bf16 copies and,
  // where the masters are sharded, drops what is not this rank's.
  void weights_changed();
  // Bytes of the on-demand (sharded) arenas backed by memory right now, as the kernel counts them: a
  // check on the memory accounting.
  size_t on_demand_resident_bytes() const;
  // ZeRO stage in effect (0 alone or without ZeRO).
  int zero_stage() const { return data_parallel_->stage(); }
  // Runs steps start_step()+1 .. train.steps, calling on_step after each; stops early (after the
  // step) when on_step returns false.
  void run(const std::function<bool(const StepMetrics&)>& on_step);
  // Steps already done (non-zero after resuming from a checkpoint).
  int64_t start_step() const { return start_step_; }
  void set_start_step(int64_t step) { start_step_ = step; }
  AdamW& optimizer() { return *optimizer_; }
  const parallel::Parallelism& parallelism() const { return par_; }

  model::ParameterStore& params() { return *params_; }
  // precision = "fp8": the scaling state (nullptr otherwise).
  model::Fp8Recipe* fp8() const { return fp8_.get(); }
  model::Transformer& model() { return *model_; }
  const RunConfig& config() const { return cfg_; }
  double model_flops_per_token() const { return flops_per_token_; }
  const TokenSource& data() const { return *data_; }

 private:
  // Why the gradient norm is non-finite: the first tensor with a non-finite gradient over the dp group
  // (collective over it), or that the culprit is on another shard.
  std::string non_finite_gradient() const;
  void inject_non_finite_gradient(int64_t step);

  // Tensor or pipeline parallelism: the shards of dp rank 0's model-parallel group gathered into whole
  // tensors on its rank 0.
  // The micro-batch of samples from `first_sample` into tokens_ / targets_ (traced as data loading):
  // under context parallelism, this rank's tokens of each.
  void load(int64_t first_sample, Split split);
  void gather_model_shards();
  // Refuses, before any step, a pipeline whose transfers its schedule cannot run without deadlock here.
  void check_pipeline_messages_fit() const;
  // Pipeline: sums the tied embedding's gradient between its two copies (first and last stage).
  void sum_tied_embedding_grads();
  // The name of the token embedding.
  const char* embedding_name() const;

  // Tokens of each sample this rank holds (seq_len / cp).
  int64_t local_seq_len() const { return cfg_.seq_len() / cp_; }
  // Sums a value over the dp / tp group (identity alone).
  double dp_sum(double v) const;
  // fp8: the step's amaxes (max) and overflow / underflow counts (sum) over every rank, into the
  // histories and `s`.
  void end_fp8_step(StepMetrics& s);
  // Mixture of experts: each block's load summed over the ranks into s.moe (and trace counters), and,
  // when the step was applied, the auxiliary-loss-free selection biases moved toward the mean load.
  void end_moe_step(StepMetrics& s, bool applied);
  double tp_sum(double v) const;
  double pp_sum(double v) const;
  // The global gradient norm: every element counted once across the tp shards (and, under ZeRO, the dp
  // pieces).
  double gradient_norm() const;

  RunConfig cfg_;
  kernels::Backend& backend_;
  parallel::Parallelism own_par_;  // when the caller gave none: the whole model, locally
  const parallel::Parallelism& par_;
  comm::ProcessGroup* dp_;  // the replicas: dp x cp ranks holding the same weights (parallelize.h)
  comm::ProcessGroup* tp_;
  comm::ProcessGroup* pp_;
  int dp_size_ = 1, dp_rank_ = 0;  // in the replica group
  // Context parallelism: cp ranks share each sample, rank cp_rank_ holding the tokens at cp_positions_
  // (spec::context_positions); the data shares go by the dp coordinate, data_rank_ of data_ranks_.
  int cp_ = 1, cp_rank_ = 0;
  int data_ranks_ = 1, data_rank_ = 0;
  std::vector<int32_t> cp_positions_;
  // DDP / ZeRO-1: the gradient arena in the dp group's registered memory, so the reductions read it in
  // place instead of staging a copy (plain memory when the group's arena has no room). Declared before
  // params_ so it outlives the views into it.
  comm::RegisteredBuffer registered_grads_;
  double peak_flops_;
  double flops_per_token_;
  std::unique_ptr<model::ParameterStore> params_;
  std::unique_ptr<model::Fp8Recipe> fp8_;
  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<parallel::DataParallel> data_parallel_;  // DDP, ZeRO-1/2/3, or nothing alone
  std::unique_ptr<StepHooks> hooks_;                       // the model's unit hooks, handed to it
  std::unique_ptr<PipelineExecutor> pipeline_;             // pp > 1: runs each step's schedule
  spec::ParamTable whole_table_;                    // tp: the whole model's table
  Tensor whole_master_, whole_m_, whole_v_;         // tp: whole tensors while a checkpoint is saved
  std::unique_ptr<AdamW> optimizer_;
  LrSchedule schedule_;
  std::unique_ptr<TokenSource> data_;
  model::ActivationContext ctx_;
  Tensor tokens_, targets_;                // this rank's tokens of each sample ([micro-batch, seq_len / cp])
  Tensor whole_tokens_, whole_targets_;    // cp > 1: the whole samples, loaded before this rank's part
  int64_t start_step_ = 0;
  int64_t tokens_seen_ = 0;
  double elapsed_ = 0;
  BadStepGuard guard_{cfg_.train.max_consecutive_skips, cfg_.train.loss_spike_zscore, cfg_.train.loss_spike_window};
};

}  // namespace loom::train
