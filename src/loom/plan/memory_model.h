// Memory per device for a layout: model state (weights, gradients, optimizer state by ZeRO stage),
// activations (by micro-batch, sequence, TP/SP, CP, recompute policy and the micro-batches the
// pipeline schedule keeps in flight), communication buffers, and the safety margin. The figure is for
// the worst pipeline stage (the first holds the most micro-batches; the last holds the LM head).
#pragma once

#include "loom/plan/layout.h"

namespace loom::plan {

// Bytes per parameter (mixed precision with AdamW, as Megatron-LM and Loom's bf16 mode keep them).
struct StateBytes {
  double weight = 2;     // bf16 compute copy
  double grad = 4;       // fp32 gradient accumulator
  double optimizer = 12; // fp32 master weight + Adam m + v
};

struct MemoryBreakdown {
  double weights = 0, grads = 0, optimizer = 0;  // model state
  double activations = 0;   // saved for backward, all in-flight micro-batches
  double logits = 0;        // LM-head logits + fp32 softmax of one micro-batch (last stage)
  double comm_buffers = 0;
  double total = 0;
  double usable = 0;        // device memory minus the safety margin
  double state() const { return weights + grads + optimizer; }
  bool fits() const { return total <= usable; }
};

// Bytes one transformer layer saves for backward, for one micro-batch, per device (Korthikanti et al.
// 2022 generalised to GQA / SwiGLU / no dropout / flash attention / CP).
double activation_bytes_per_layer(const Layout& l, const Job& j);
// Micro-batches the first stage holds at once (in units of "all of its layers for one micro-batch").
double in_flight_micro_batches(const Layout& l, const Job& j);
// Parameters held by a device of the first (`last` = false) or the last pipeline stage, before ZeRO.
struct StageParams {
  double dense = 0;   // replicated over dp (sharded by tp)
  double expert = 0;  // sharded by ep (and tp)
};
StageParams stage_params(const Layout& l, const Job& j, bool last);
// Pipeline stage `stage` (0 .. pp - 1; the first holds the embedding, the last the head): its blocks
// from the layout's cut (plan::pipeline_cut: explicit, or the ends trimmed) when it is uneven, else
// n_layers / pp.
StageParams stage_params_of(const Layout& l, const Job& j, int stage);
double stage_layers(const Layout& l, const Job& j, int stage);

MemoryBreakdown memory_per_device(const Layout& l, const Job& j);

}  // namespace loom::plan
