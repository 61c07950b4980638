// What Loom's own engine holds per rank, in the categories its allocator reports (parameters,
// gradients, optimizer, activations), for the layouts it runs today (data parallelism with ZeRO 0-3,
// tensor parallelism with or without sequence parallelism, pipeline parallelism with ZeRO 0-1):
// the planner's prediction of `loom train --json`'s peak_bytes_by_category, derived from the model
// description alone. It mirrors the engine's buffers (model/activations.h, spec/shard_plan.h,
// parallel/zero_engine.*) and differs from the Megatron-style memory model (memory_model.h) in its
// conventions: f32 masters count as parameters, activations are the engine's f32 tensors plus bf16
// copies of GEMM inputs, and ZeRO-3's gathered units and ZeRO-2/3's gradient scratch are peaks.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/plan/layout.h"
#include "loom/spec/pipeline_schedule.h"
#include "loom/spec/transformer_config.h"

namespace loom::plan {

struct EngineMemory {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0;  // peak bytes of dp rank 0
  double state() const { return parameters + gradients + optimizer; }
  double total() const { return state() + activations; }
};

// The planner's name for a schedule the engine runs, and back.
spec::PipelineSchedule engine_schedule(Schedule s);
Schedule planner_schedule(spec::PipelineSchedule s);

// Under pipeline parallelism: the micro-batches of one step per pipeline (the schedule's m) and an
// explicit cut (blocks per chunk; empty: balanced as the engine cuts), which decide rank 0's chunks
// and how many activation contexts it holds (spec::contexts_held).
struct EnginePipeline {
  int64_t micro_batches = 1;
  std::vector<int64_t> layers;
  bool bf16_transfers = true;  // bf16 runs: one bf16 send and one receive buffer of a micro-batch's residual rows
};

// Peak bytes per category of rank 0 (or of a pipeline stage's first rank) for `cfg` trained under layout `l` (dp, tp, sp, zero, micro_batch,
// pp with its schedule and vpp; cp, ep must be 1; ZeRO 2/3 not with pp) at sequence length `seq`, in
// bf16 or fp32 mode (`numerics`). Checkpoint saves are not in it (rank 0 then gathers whole tensors for a while).
// pipeline_rank: which stage's rank (tp rank 0 of it) under pp; the first stage holds the embeddings,
// the last the head and its logits, so the heaviest may be any (a memory check takes the largest).
// How the engine holds the weights: fp32 (bf16 false), bf16 GEMMs reading bf16 copies of f32 masters,
// or (bf16_only, precision = "bf16-pure") bf16 weights and Adam moments with no master. Converts from
// a bool (bf16 GEMMs with masters) so the fp32 / bf16 callers read as before.
struct EngineNumerics {
  bool bf16 = false, bf16_only = false;
  EngineNumerics(bool bf16_gemms = false, bool weights_only = false) : bf16(bf16_gemms || weights_only), bf16_only(weights_only) {}
};

EngineMemory loom_engine_memory(const spec::TransformerConfig& cfg, const Layout& l, int64_t seq, EngineNumerics numerics,
                                const EnginePipeline& pipe = {}, int pipeline_rank = 0);

}  // namespace loom::plan
