// The bytes Loom's own memory-bound kernels move in a training step, as each kernel declares them in
// its trace span (kernels/*: read + written, f32 activations in both precisions, bf16 copies of GEMM
// operands in bf16 runs). The time model prices the engine's memory-bound class from these
// (`--engine loom`, and `loom profile report`'s prediction) instead of Megatron-LM's fused bf16 kernels;
// tests/plan/plan_engine_time_test.cpp holds them to a traced run's declared bytes.
#pragma once

#include "loom/plan/layout.h"
#include "loom/spec/transformer_config.h"

namespace loom::plan {

struct EngineStreamBytes {
  double per_block = 0;            // one block, one micro-batch, forward + backward (+ recompute)
  double recompute_block = 0;      // of per_block: what l.recompute runs again in backward
  double first_stage = 0;          // per micro-batch on the rank holding the embedding (fwd + bwd)
  double last_stage = 0;           // per micro-batch on the rank holding the final norm, head and loss
  double per_local_parameter = 0;  // the optimizer step, gradient norm and zeroing, per parameter the rank updates
};

// For `cfg` under layout `l` (tp splits the widths, SP the norms' rows) at `seq` tokens, micro-batches
// of l.micro_batch sequences, in bf16 (true) or fp32 mode.
EngineStreamBytes engine_stream_bytes(const spec::TransformerConfig& cfg, const Layout& l, int64_t seq, bool bf16);

}  // namespace loom::plan
