#include "loom/plan/memory_model.h"

#include "loom/plan/engine_memory.h"
#include "loom/spec/param_table.h"
#include "loom/spec/pipeline_stages.h"

#include <algorithm>

namespace loom::plan {

double activation_bytes_per_layer(const Layout& l, const Job& j) {
  const auto& c = j.model.cfg;
  const double s = static_cast<double>(j.seq) / l.cp;  // local sequence
  const double b = l.micro_batch, h = static_cast<double>(c.d_model), t = l.tp;
  const double sbh = s * b * h;
  // K and V width on a rank relative to h: n_kv / n_heads / t, or one replicated head when tp exceeds
  // the KV heads.
  const double kv_rank = static_cast<double>(spec::kv_heads_per_rank(c, l.tp) * c.head_dim()) / h;
  const double F = static_cast<double>(c.d_ff) / h;
  // Each token passes through top_k expert MLPs; the busiest rank holds moe_imbalance times the mean.
  const double k = static_cast<double>(j.model.top_k()) * (j.model.is_moe() ? j.software.moe_imbalance : 1.0);
  const bool gpt2 = c.arch == spec::Arch::GPT2;
  if (l.recompute == Recompute::Full) return 2.0 * sbh / (l.sp ? t : 1.0);  // only the layer input
  // Per sbh element, bytes (16-bit activations, 1-byte dropout masks), Korthikanti et al. section 4:
  // replicated across TP ranks unless SP: two norm inputs (4), attention and MLP inputs (4), masks (2).
  // Under fp8 the linear layers save their inputs as fp8 (`in` = 1 byte instead of 2).
  const double in = j.precision == "fp8" ? 1 : 2;
  double replicated = 4 + 2 * in + (j.software.dropout ? 2 : 0);
  // Split by TP: Q (2), attention output (the projection's input, 2); MLP hidden: GeLU input and
  // output (2 + 2, the output being the second GEMM's input) per F, or SwiGLU gate, up and product
  // (2 + 2 + 2), times top_k for MoE. K and V (4 per element of their width on this rank).
  double split = 2 + in + (gpt2 ? 2 + in : 4 + in) * F * k;
  if (j.model.is_moe()) replicated += 2;  // router input copy
  double per_sbh = (l.sp ? replicated / t : replicated) + split / t + 4 * kv_rank;
  double bytes = sbh * per_sbh;
  // Attention scores: softmax output (2) + dropout mask (1) + dropout output (2) = 5 a s^2 b bytes when
  // the T x T matrix is materialised and not recomputed; flash attention keeps only the fp32 row
  // statistics. Selective recompute drops exactly this term.
  const double heads = static_cast<double>(c.n_heads) / t;
  if (!j.software.flash_attention && l.recompute == Recompute::None)
    bytes += (j.software.dropout ? 5.0 : 2.0) * heads * s * static_cast<double>(j.seq) * b;
  if (j.software.flash_attention) bytes += 4.0 * heads * s * b;
  return bytes;
}

double in_flight_micro_batches(const Layout& l, const Job& j) {
  const double m = static_cast<double>(micro_batches(l, j)), p = l.pp;
  if (l.pp == 1) return 1;
  switch (l.schedule) {
    case Schedule::GPipe: return m;  // every forward before any backward
    case Schedule::OneFOneB:
    case Schedule::ZeroBubble:  // ZB-H1 keeps 1F1B's peak (Qi et al. 2023)
      return std::min(m, p);
    case Schedule::Interleaved:  // Korthikanti et al.: first stage holds (1 + (p-1)/(p v)) x p micro-batches
      return std::min(m, p) * (1 + (p - 1) / (p * l.vpp));
  }
  return p;
}

double stage_layers(const Layout& l, const Job& j, int stage) {
  const std::vector<int64_t> cut = pipeline_cut(l, j);
  if (cut.empty() || l.pp == 1) return static_cast<double>(j.model.cfg.n_layers) / l.pp;
  return static_cast<double>(spec::PipelineStages{l.pp, l.vpp, cut}.blocks_on(stage));
}

StageParams stage_params(const Layout& l, const Job& j, bool last) { return stage_params_of(l, j, last ? l.pp - 1 : 0); }

StageParams stage_params_of(const Layout& l, const Job& j, int stage) {
  const auto& c = j.model.cfg;
  ParamCounts pc = count_params(j.model);
  const bool last = stage == l.pp - 1, first = stage == 0;
  const double layers = stage_layers(l, j, stage);
  StageParams sp;
  const double dense_layer = static_cast<double>(pc.per_layer - pc.per_layer_expert);
  sp.dense = layers * dense_layer / l.tp;
  // Replicated KV heads: each rank holds one head's K and V projections, not n_kv / tp of them.
  const double kv_head_params = 2.0 * static_cast<double>(c.head_dim() * c.d_model + (c.uses_bias() ? c.head_dim() : 0));
  sp.dense += layers * kv_head_params *
              (static_cast<double>(spec::kv_heads_per_rank(c, l.tp)) - static_cast<double>(c.n_kv_heads) / l.tp);
  sp.expert = layers * static_cast<double>(pc.per_layer_expert) / (double(l.tp) * l.ep);
  // Vocab-parallel embedding on the first stage; the LM head (or the tied embedding's copy) and the
  // final norm on the last. With pp = 1 both sit on the one stage (a tied embedding is stored once).
  const double embed = static_cast<double>(pc.embedding) / l.tp;
  const double head = static_cast<double>(pc.lm_head ? pc.lm_head : c.vocab_size * c.d_model) / l.tp;
  if (l.pp == 1) {
    sp.dense += embed + static_cast<double>(pc.final_norm) + static_cast<double>(pc.lm_head) / l.tp;
  } else if (last) {
    sp.dense += head + static_cast<double>(pc.final_norm);
  } else if (first) {
    sp.dense += embed;
  }
  return sp;
}

namespace {

MemoryBreakdown stage_memory(const Layout& l, const Job& j, int stage) {
  const bool last = stage == l.pp - 1;
  StateBytes sb;
  if (j.software.bf16_weights_only) sb.optimizer = 4;  // bf16 m and v, no master
  const StageParams p = stage_params_of(l, j, stage);
  const double dp = l.dp, edp = static_cast<double>(l.dp) / l.ep;  // experts replicate over dp/ep
  auto shard = [&](double bytes_per_param, int from_stage) {
    return l.zero >= from_stage ? p.dense * bytes_per_param / dp + p.expert * bytes_per_param / edp
                                : (p.dense + p.expert) * bytes_per_param;
  };
  MemoryBreakdown m;
  m.weights = shard(sb.weight, 3);
  // The gradient buffer is held in the dtype it is reduced in: fp32 (Megatron's main_grad, FSDP's
  // default), or bf16 where the software reduces bf16 (NeMo's grad_sync_dtype, DeepSpeed's bf16 grads).
  m.grads = shard(j.software.grad_bytes, 2);
  m.optimizer = shard(sb.optimizer, 1);
  if (j.precision == "fp8") {
    // The layers' weights cast to fp8, with a transposed copy for backward, kept across the
    // micro-batches (Transformer Engine): 2 bytes per layer parameter, sharded like the weights.
    const ParamCounts pc = count_params(j.model);
    const double n_layers = stage_layers(l, j, stage);
    const double dense = n_layers * static_cast<double>(pc.per_layer - pc.per_layer_expert) / l.tp;
    const double expert = n_layers * static_cast<double>(pc.per_layer_expert) / (double(l.tp) * l.ep);
    m.weights += 2 * (l.zero >= 3 ? dense / dp + expert / edp : dense + expert);
  }

  const auto& c = j.model.cfg;
  const double layers = stage_layers(l, j, stage);
  const double per_layer = activation_bytes_per_layer(l, j);
  const double s = static_cast<double>(j.seq) / l.cp, b = l.micro_batch, h = static_cast<double>(c.d_model);
  // The last stage runs each micro-batch's backward right after its forward: one in flight; stage r
  // of a 1F1B-like schedule holds (p - r) / p of the first stage's (GPipe: all m on every stage).
  double in_flight = last && l.pp > 1 ? 1.0 : in_flight_micro_batches(l, j);
  if (!last && stage > 0 && l.schedule != Schedule::GPipe) in_flight = std::max(1.0, in_flight * (l.pp - stage) / l.pp);
  m.activations = layers * per_layer * in_flight;
  if (last) m.logits = s * b * static_cast<double>(c.vocab_size) / l.tp * (2 + 4);  // bf16 logits + fp32 softmax

  // Communication buffers: the SP/TP all-gathered layer input (bf16, full sequence), pipeline send and
  // receive buffers, ZeRO-3's prefetched layer (two layers of bf16 weights), the EP dispatch buffers.
  double comm = 0;
  if (l.tp > 1) comm += 2 * s * b * h * 2;
  if (l.pp > 1) comm += 2 * 2 * s * b * h * 2 / (l.tp > 1 ? l.tp : 1);
  if (l.zero == 3) comm += 2 * (p.dense + p.expert) / layers * sb.weight;
  if (j.model.is_moe()) comm += 2 * 2 * s * b * h * static_cast<double>(j.model.top_k()) * j.software.moe_imbalance * 2;
  m.comm_buffers = comm;
  m.total = m.state() + m.activations + m.logits + m.comm_buffers;
  m.usable = j.cluster.hw.device.memory_bytes * (1 - j.memory_margin);
  return m;
}

}  // namespace

MemoryBreakdown memory_per_device(const Layout& l, const Job& j) {
  if (j.software.loom_engine) {
    const EngineMemory e =
        loom_engine_memory(j.model.cfg, l, j.seq, {j.precision == "bf16", j.software.bf16_weights_only},
                           {micro_batches(l, j), j.software.pipeline_layers});
    MemoryBreakdown m;
    m.weights = e.parameters, m.grads = e.gradients, m.optimizer = e.optimizer, m.activations = e.activations;
    m.total = e.total();
    m.usable = j.cluster.hw.device.memory_bytes * (1 - j.memory_margin);
    return m;
  }
  if (l.pp == 1) return stage_memory(l, j, 0);  // one stage holds embedding, layers and head
  MemoryBreakdown first = stage_memory(l, j, 0), last = stage_memory(l, j, l.pp - 1);
  MemoryBreakdown worst = last.total > first.total ? last : first;
  // An uneven cut (explicit, or the trimmed ends) may make a middle stage the heaviest.
  if (!pipeline_cut(l, j).empty())
    for (int r = 1; r + 1 < l.pp; ++r)
      if (MemoryBreakdown m = stage_memory(l, j, r); m.total > worst.total) worst = m;
  return worst;
}

}  // namespace loom::plan
