#include "loom/plan/time_model.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "loom/plan/collective_cost.h"
#include "loom/plan/engine_stream_bytes.h"
#include "loom/plan/memory_model.h"
#include "loom/spec/param_table.h"
#include "loom/spec/pipeline_stages.h"

namespace loom::plan {

double gemm_time(const GemmShape& g, const Hardware& hw, double peak, double bytes_per_element) {
  if (g.M <= 0 || g.N <= 0 || g.K <= 0 || g.count <= 0) return 0;
  auto same = [](double a, double b) { return std::abs(a - b) < 0.5; };
  for (const auto& m : hw.gemm_table)
    if (m.ranks == 1 && m.bytes == bytes_per_element && same(m.M, g.M) && same(m.N, g.N) && same(m.K, g.K))
      return g.count * 2 * g.M * g.N * g.K / m.flops_per_s;
  const auto& e = hw.efficiency;
  auto fill = [&](double d) { return d / (d + e.gemm_half_dim); };
  const double eff = e.gemm_max * fill(g.M) * fill(g.N) * fill(g.K);
  const double flops = 2 * g.M * g.N * g.K;
  const double bytes = bytes_per_element * (g.M * g.K + g.K * g.N + g.M * g.N);
  const double bw = hw.device.memory_bandwidth * e.memory;
  return g.count * std::max(flops / (peak * eff), bytes / bw);
}

std::string StepTime::bound() const {
  // The attention core is kept with the memory-bound kernels (it is not a projection GEMM), but it is
  // FLOPs at a GEMM-like rate: a step bound by it is bound by compute (at 128K tokens it outweighs the
  // projections).
  const double parts[] = {compute + attention_in_compute(), memory_bound - attention_in_compute(), comm_exposed, bubble};
  const char* names[] = {"compute", "memory", "communication", "bubble"};
  return names[std::max_element(parts, parts + 4) - parts];
}

namespace {

// Costs of one layer for one micro-batch on one device, forward only; backward and recompute derive
// from these.
struct LayerCost {
  double gemm = 0;        // projection and MLP GEMMs
  double gemm_attn = 0;   // the part of `gemm` around attention (QKV, output projection): TP overlap pairs
  double gemm_mlp = 0;    // the MLP's (and router's): its TP collectives with these
  double cast_fwd = 0;    // fp8: casting the linear GEMMs' inputs (memory-bound)
  double cast_bwd = 0;    // fp8: casting their output gradients
  double fp8_weights = 0; // fp8: weight elements cast to fp8 (and transposed) once per step
  double attn_core = 0;   // attention scores / softmax / weighted sum (GEMMs and memory traffic)
  double memory = 0;      // norms, residual adds, dropout, activation functions, RoPE
  double tp_comm = 0;     // TP / SP collectives of the forward
  double cp_comm = 0;     // CP ring exchange of K and V
  double cp_a2a_fwd = 0;  // CP all-to-all (Loom's Ulysses mode): the forward's two, waited for at once
  double cp_a2a_bwd = 0;  // and the backward's two
  double ep_comm = 0;     // MoE dispatch + combine
  double ep_comm_bwd = 0; // their gradients' (Loom's engine: f32 both ways)
  double flops = 0;       // executed GEMM FLOPs (incl. attention)
};

GroupShape group(int n, int stride, int per_node_devices) {
  return {n, std::clamp(per_node_devices / stride, 1, n)};
}

LayerCost layer_cost(const Layout& l, const Job& j, double peak) {
  const auto& c = j.model.cfg;
  const auto& hw = j.cluster.hw;
  const auto& sw = j.software;
  const double t = l.tp, s = static_cast<double>(j.seq) / l.cp, S = static_cast<double>(j.seq);
  const double b = l.micro_batch, n = s * b, h = static_cast<double>(c.d_model);
  const double hd = static_cast<double>(c.head_dim()), heads = c.n_heads / t;
  const double q = c.n_heads * hd, F = static_cast<double>(c.d_ff);
  // K and V width on a rank: kv / t, or one replicated head when tp exceeds the KV heads.
  const double kv_t = static_cast<double>(spec::kv_heads_per_rank(c, l.tp)) * hd;
  const double bw = hw.device.memory_bandwidth * hw.efficiency.memory;
  const double act = j.precision == "f32" ? 4 : 2;  // bytes per activation element (f32: Loom's fp32 runs)
  const bool gpt2 = c.arch == spec::Arch::GPT2;
  LayerCost lc;
  // fp8 (Transformer Engine's recipe): the linear layers' GEMMs run at the fp8 peak on 1-byte operands;
  // each casts its input (forward) and its output gradient (backward) to fp8 with a transposed copy
  // (read 2 + write 2 bytes an element), and its weight once per step. Attention and the LM head stay
  // 16-bit.
  const bool fp8 = j.precision == "fp8";
  const double peak16 = fp8 ? hw.peak("bf16") : peak;
  // Current scaling reads each quantised input once more for its amax first (delayed scaling takes
  // it from the history, blockwise in the cast pass itself).
  const double cast_bytes = sw.fp8_recipe == "current" ? 6 : 4;
  auto linear = [&](GemmShape g) {
    lc.flops += 2 * g.M * g.N * g.K * g.count;
    if (!fp8) return gemm_time(g, hw, peak, act);
    lc.cast_fwd += cast_bytes * g.count * g.M * g.K / bw;
    lc.cast_bwd += cast_bytes * g.count * g.M * g.N / bw;
    lc.fp8_weights += g.count * g.K * g.N;
    return gemm_time(g, hw, peak, 1);
  };
  auto gemm16 = [&](GemmShape g) {
    lc.flops += 2 * g.M * g.N * g.K * g.count;
    return gemm_time(g, hw, peak16, act);
  };
  lc.gemm_attn += linear({n, q / t + 2 * kv_t, h});  // QKV
  lc.gemm_attn += linear({n, h, q / t});             // output projection
  const double E = static_cast<double>(j.model.n_experts());
  // MoE: the device's E/ep experts see n*top_k tokens in all, n*ep*top_k/E each on average, and the
  // busiest rank moe_imbalance times that.
  const double k = static_cast<double>(j.model.top_k()) * (j.model.is_moe() ? sw.moe_imbalance : 1.0);
  // A layer's cost is the mean over the model's blocks: `moe_share` of them are MoE blocks (every k-th,
  // after the first dense ones), whose experts are SwiGLU MLPs of the expert width (model.moe.d_expert,
  // not d_ff), with the shared experts as one dense SwiGLU MLP beside them; the rest keep the dense MLP.
  const double moe_share = j.model.is_moe() ? static_cast<double>(c.moe_layer_count()) / static_cast<double>(c.n_layers) : 0;
  const double Fe = static_cast<double>(c.expert_width()), Fs = static_cast<double>(c.moe.shared_experts) * Fe;
  auto share = [&](double weight, auto&& cost) {  // weight x cost, FLOPs counted alike
    const double flops0 = lc.flops, time = cost();
    lc.flops = flops0 + weight * (lc.flops - flops0);
    return weight * time;
  };
  if (moe_share < 1)
    lc.gemm_mlp += share(1 - moe_share, [&] {
      return linear({n, (gpt2 ? F : 2 * F) / t, h}) + linear({n, h, F / t});
    });
  if (moe_share > 0)
    lc.gemm_mlp += share(moe_share, [&] {
      const double experts = E / l.ep, rows = n * l.ep * k / E;
      double time = linear({rows, 2 * Fe / t, h, experts}) + linear({rows, h, Fe / t, experts});
      if (Fs > 0) time += linear({n, 2 * Fs / t, h}) + linear({n, h, Fs / t});
      return time + gemm16({n, E, h});  // router
    });
  lc.gemm = lc.gemm_attn + lc.gemm_mlp;

  // Attention core. Flash: causal blocks only (half the square), no score traffic. Materialised
  // (Megatron 2021-22): the full T x T square in batched GEMMs, plus the scale-mask-softmax and dropout
  // passes over the scores: read 2 + write 2 (softmax), read 2 + write 2 + mask 1 (dropout) bytes.
  if (sw.flash_attention) {
    const double before = lc.flops;
    // A kernel slower than FlashAttention-2 (Software::attention_speed) takes that much longer.
    lc.attn_core += (gemm16({s, S / 2, hd, b * heads}) + gemm16({s, hd, S / 2, b * heads})) / sw.attention_speed();
    // A device whose attention kernel was measured (`loom calibrate`: Loom's own, on a CPU) runs it at
    // that rate when it is below the GEMM curve's.
    // At the model's own shape where calibrate timed it (a context-parallel rank's chunk is not one).
    const bool bf16 = j.precision != "f32";
    const double rate = l.cp == 1 ? hw.attention_rate(b, S, heads, kv_t / hd, hd, bf16) : hw.device.attention_rate(bf16);
    if (rate > 0) lc.attn_core = std::max(lc.attn_core, (lc.flops - before) / rate);
  } else {
    lc.attn_core += gemm16({s, S, hd, b * heads}) + gemm16({s, hd, S, b * heads});
    lc.attn_core += b * heads * s * S * (sw.dropout ? 9.0 : 4.0) / bw;
  }
  // Memory-bound kernels, bytes per sbh element: two norms (read + write: 8), two residual adds
  // (fused bias-dropout-add: read x, residual, write, mask: 7 each; 6 without dropout) -- these run
  // replicated on every TP rank unless SP splits them; the activation function on the split MLP
  // hidden (GeLU read + write 4F/h; SwiGLU read 2, write 1: 6F/h), RoPE on q and k.
  const double replicated = 8 + (sw.dropout ? 14 : 12);
  // The activation: the dense MLP's on n rows, or the experts' SwiGLU on n k rows and the shared experts'.
  const double hidden = (1 - moe_share) * (gpt2 ? 4 : 6) * F + moe_share * 6 * (Fe * k + Fs);
  double per_sbh = (l.sp ? replicated / t : replicated) + hidden / h / t;
  if (!gpt2) per_sbh += 4 * (q / t + kv_t) / h;
  lc.memory = n * h * per_sbh / bw;

  // TP: two all-reduces (or all-gather + reduce-scatter pairs with SP: the same bus bytes) of the
  // [n, h] activations per forward, on the intra-node link when the TP group fits in a node.
  const int dpn = hw.devices_per_node;
  // Loom's engine keeps activations in f32 in both precisions, so its TP collectives move 4 bytes.
  const double wire = sw.loom_engine ? 4 : act;
  // Activations: staged by a shared-memory transport (Hardware::staged_intra_node), as CP's, EP's and
  // the pipeline's transfers below.
  lc.tp_comm = 2 * group_collective_time(Collective::AllReduce, n * h * wire, group(l.tp, 1, dpn), hw, true);
  // CP: each rank passes its K,V chunk around the ring (cp - 1 hops), overlapped with attention.
  // Loom's engine moves f32 buffers either way; in all-to-all mode (Ulysses) it sends Q, K, V to the head
  // shards and the output back (backward: [dO | O] there and dQ, dK, dV back), nothing overlapped.
  if (l.cp > 1 && sw.loom_engine && l.cp_all_to_all) {
    const GroupShape g = group(l.cp, l.tp, dpn);
    const double qkv = n * (q / t + 2 * kv_t) * 4 * l.cp, out = n * (q / t) * 4 * l.cp;  // all ranks' bytes
    lc.cp_a2a_fwd = group_collective_time(Collective::AllToAll, qkv, g, hw, true) +
                    group_collective_time(Collective::AllToAll, out, g, hw, true);
    lc.cp_a2a_bwd = group_collective_time(Collective::AllToAll, 2 * out, g, hw, true) +
                    group_collective_time(Collective::AllToAll, qkv, g, hw, true);
  } else if (l.cp > 1) {
    const double chunk = n * 2 * kv_t * (sw.loom_engine ? 4 : act);
    const Link& link = dpn / l.tp >= l.cp ? hw.intra_link(true) : hw.inter_node;
    lc.cp_comm = (l.cp - 1) * collective_time(Collective::SendRecv, chunk, 2, link, hw.efficiency.link);
  }
  // EP: dispatch and combine all-to-alls of the routed tokens, in the MoE blocks. Loom's engine sends
  // the rows in GEMM precision and brings the outputs back in f32 (the whole rows: every tp rank routes
  // the whole micro-batch); Megatron both ways in the activations' precision, 1/tp of them per tp rank.
  if (l.ep > 1) {
    const GroupShape g = group(l.ep, l.tp * l.cp, dpn);
    const double rows = n * k * l.ep;
    const double f32_rows = group_collective_time(Collective::AllToAll, rows * h * 4, g, hw, true);
    lc.ep_comm = sw.loom_engine ? group_collective_time(Collective::AllToAll, rows * h * act, g, hw, true) + f32_rows
                                : 2 * group_collective_time(Collective::AllToAll, rows * h * act / t, g, hw, true);
    lc.ep_comm_bwd = sw.loom_engine ? 2 * f32_rows : lc.ep_comm;
    lc.ep_comm *= moe_share, lc.ep_comm_bwd *= moe_share;
  }
  return lc;
}

}  // namespace

StepTime step_time(const Layout& l, const Job& j) {
  const auto& c = j.model.cfg;
  const auto& hw = j.cluster.hw;
  const double peak = hw.peak(j.precision);
  const LayerCost lc = layer_cost(l, j, peak);
  const double bw = hw.device.memory_bandwidth * hw.efficiency.memory;
  const double m = static_cast<double>(micro_batches(l, j));
  const double s = static_cast<double>(j.seq) / l.cp, b = l.micro_batch, n = s * b, h = static_cast<double>(c.d_model);
  const int dpn = hw.devices_per_node;

  // One micro-batch through one layer: forward, backward (dgrad + wgrad: twice the forward GEMMs; the
  // memory-bound kernels read saved inputs and gradients: about twice the bytes), recompute.
  const double cp_fwd = lc.cp_a2a_fwd + std::max(0.0, lc.cp_comm - lc.attn_core);  // ring hidden behind attention
  const double cp_bwd = lc.cp_a2a_bwd + std::max(0.0, 2 * lc.cp_comm - 2 * lc.attn_core);  // K,V and their gradients
  // Flash attention's backward recomputes the scores and probabilities: five GEMM-sized passes to the
  // forward's two, 2.5x its work (Dao 2023, FlashAttention-2, section 3.1; Loom's kernel declares the same).
  const double attn_bwd = j.software.flash_attention ? 2.5 : 2.0;
  double comp = 3 * lc.gemm, mem = 3 * lc.memory + lc.cast_fwd + lc.cast_bwd, attn = (1 + attn_bwd) * lc.attn_core;
  double ep = lc.ep_comm + lc.ep_comm_bwd, cp = cp_fwd + cp_bwd;
  // TP traffic per block (attention, MLP): forward one all-reduce (with SP: an all-gather before the
  // block's first GEMM and a reduce-scatter after its last -- the same bus bytes), backward the same
  // again. Sequence parallelism saves each GEMM input as its 1/t shard, so backward also all-gathers it
  // again for the weight-gradient GEMM: half the forward's traffic more. Full recompute gathers the
  // input in its recomputed forward instead (counted below).
  const double block_comm = lc.tp_comm / 2;
  // (Loom's engine gathers it again in backward under full recompute too: its TP ops keep no gathered input.)
  const double bwd_block_comm =
      block_comm * (l.sp && (l.recompute != Recompute::Full || j.software.loom_engine) ? 1.5 : 1.0);
  // Without TP overlap (Megatron's default, and the 2021-22 runs) every TP collective is exposed. With
  // it (Megatron-Core's --tp-comm-overlap, which needs SP) each block's collectives are cut into tp
  // chunks that run under the block's GEMMs: exposed is what the GEMMs cannot cover, and at least the
  // one chunk that has nothing to hide behind.
  // (Not on a machine whose collectives run on the compute cores: hiding them only takes the GEMMs' cycles.)
  const bool overlap = j.software.tp_overlap && l.sp && l.tp > 1 && !j.software.comm_on_compute_cores;
  auto exposed = [&](double comm, double gemms) {
    return overlap ? std::max(comm / l.tp, comm - gemms) : comm;
  };
  const double tp_fwd = exposed(block_comm, lc.gemm_attn) + exposed(block_comm, lc.gemm_mlp);
  const double tp_bwd = exposed(bwd_block_comm, 2 * lc.gemm_attn) + exposed(bwd_block_comm, 2 * lc.gemm_mlp);
  double tp = tp_fwd + tp_bwd;
  // Per block, the TP and CP traffic that runs under compute (slows it: efficiency.overlap_slowdown).
  double hidden_block = 2 * block_comm + 2 * bwd_block_comm - tp + 3 * std::min(lc.cp_comm, lc.attn_core);
  double rec = 0;
  if (l.recompute == Recompute::Full) {
    hidden_block += 2 * block_comm - tp_fwd + std::min(lc.cp_comm, lc.attn_core);
    comp += lc.gemm, mem += lc.memory + lc.cast_fwd, attn += lc.attn_core, tp += tp_fwd, ep += lc.ep_comm, cp += cp_fwd;
    rec = lc.gemm + lc.memory + lc.cast_fwd + lc.attn_core;
  } else if (l.recompute == Recompute::Selective && (!j.software.flash_attention || j.software.loom_engine)) {
    // Flash attention's backward already recomputes its scores: Megatron's selective then runs nothing
    // again. Loom's engine's selective does not keep the attention core's output, and runs it again.
    attn += lc.attn_core;
    rec = lc.attn_core;
  }
  // The LM head (last stage) and the loss: GEMM [n, h] x [h, V/tp], fwd + bwd; softmax-CE reads and
  // writes fp32 logits.
  const double V = static_cast<double>(c.vocab_size);
  const double peak16 = j.precision == "fp8" ? hw.peak("bf16") : peak;  // the head stays 16-bit under fp8
  const double head = 3 * gemm_time({n, V / l.tp, h}, hw, peak16, j.precision == "f32" ? 4 : 2);
  double loss = n * V / l.tp * 16 / bw;  // memory-bound: priced with the other streaming kernels
  double embedding = 0;                 // Megatron's embedding lookup is not priced (tiny beside the blocks)
  // Loom's engine: the bytes its own kernels move (f32 activations, bf16 copies of GEMM operands), not
  // Megatron's fused bf16 kernels.
  const bool engine = j.software.loom_engine;
  const EngineStreamBytes eb = engine ? engine_stream_bytes(c, l, j.seq, j.precision == "bf16") : EngineStreamBytes{};
  if (engine) {
    mem = eb.per_block / bw, loss = eb.last_stage / bw, embedding = eb.first_stage / bw;
    // The recomputed forward's streaming kernels are the engine's own too.
    if (l.recompute == Recompute::Full) rec = lc.gemm + eb.recompute_block / bw + lc.attn_core;
    if (l.recompute == Recompute::Selective) rec = lc.attn_core + eb.recompute_block / bw;
  }
  const double head_flops = 3 * 2 * n * V / l.tp * h;
  // Stacks that run slower per FLOP without full activation recompute (Software::no_recompute_slowdown).
  // Selective too: it keeps every activation but the attention core's, which flash attention does not
  // store anyway, so a stack's selective run holds what its run without recompute holds.
  if (l.recompute != Recompute::Full && j.software.no_recompute_slowdown > 0) {
    const double slower = 1 + j.software.no_recompute_slowdown;
    comp *= slower, mem *= slower, attn *= slower;
  }

  // Pipeline p2p: each micro-batch crosses every chunk boundary forward and backward; Megatron's
  // scatter-gather sends 1/tp of the activation per TP rank, and the receiver then all-gathers the tp
  // pieces over the intra-node link to rebuild the full activation (Narayanan et al. SC21, section
  // 4.1; without SP every TP rank needs all of it). Blocking, so both are on the critical path.
  double p2p = 0;
  if (l.pp > 1) {
    const bool inter = l.tp * l.cp * l.dp >= dpn;
    const Link& link = inter ? hw.inter_node : hw.intra_link(true);
    const double act = j.precision == "f32" ? 4 : 2;
    const double piece = n * h * act / l.tp;
    double hop = collective_time(Collective::SendRecv, piece, 2, link, hw.efficiency.link);
    if (l.tp > 1 && !l.sp)
      hop += group_collective_time(Collective::AllGather, n * h * act, group(l.tp, 1, dpn), hw, true);
    p2p = 2 * l.vpp * hop;
  }
  // Per micro-batch on the slowest stage. Megatron cuts the blocks evenly, so the last stage (it adds
  // the head) is the slowest; Loom's engine cuts them by cost (spec::cut_pipeline), and an explicit
  // list (--pipeline-layers), or the trimmed ends where pp x v does not divide the blocks (pipeline_cut),
  // may cut either unevenly, so then each stage is priced and the slowest kept.
  double layers = static_cast<double>(c.n_layers) / l.pp;
  bool holds_head = true;
  int priced_stage = l.pp - 1;
  std::optional<double> other_stages;  // uneven stages: the other stages' micro-batch times, summed
  std::vector<double> stage_times;
  // Uneven stages (Loom's engine, or an uneven cut for either profile): every stage priced, the
  // slowest kept.
  const std::vector<int64_t> uneven_cut = pipeline_cut(l, j);
  if ((j.software.loom_engine || !uneven_cut.empty()) && l.pp > 1) {
    const spec::PipelineStages cut = spec::cut_pipeline(c, j.seq, l.pp, l.vpp, uneven_cut);
    double slowest = -1, all_stages = 0;
    for (int r = 0; r < l.pp; ++r) {
      const double blocks = static_cast<double>(cut.blocks_on(r));
      const bool head_here = cut.rank_of(cut.chunks() - 1) == r;
      const double t =
          blocks * (comp + mem + attn + tp + ep + cp) + (head_here ? head + loss : 0) + (r == 0 ? embedding : 0);
      if (t > slowest) slowest = t, layers = blocks, holds_head = head_here, priced_stage = r;
      all_stages += t;
      stage_times.push_back(t);
    }
    other_stages = all_stages - slowest;
  }
  const bool holds_embedding = priced_stage == 0 || l.pp == 1;
  const double stage_compute = layers * comp + (holds_head ? head : 0);
  const double stage_mem = layers * (mem + attn) + (holds_head ? loss : 0) + (holds_embedding ? embedding : 0);
  const double stage_comm = layers * (tp + ep + cp) + p2p;
  const double per_mb = stage_compute + stage_mem + stage_comm;

  StepTime st;
  st.priced_stage = priced_stage;
  st.stage_micro_batch = stage_times;
  st.compute = m * stage_compute;
  st.memory_bound = m * stage_mem;
  st.tp = m * layers * tp, st.ep = m * layers * ep, st.cp = m * layers * cp, st.pp = m * p2p;
  // Replicated KV heads (tp > n_kv_heads): the ranks holding one head alike sum its K and V weight
  // gradients once per step, every layer (inside the tp group, so inside a node).
  if (c.n_kv_heads < l.tp) {
    const double kv_grad = 2 * static_cast<double>(c.head_dim()) * h * j.software.grad_bytes;
    const int replicas = l.tp / static_cast<int>(c.n_kv_heads);
    st.tp += layers * group_collective_time(Collective::AllReduce, kv_grad,
                                            group(replicas, static_cast<int>(c.n_kv_heads), dpn), hw, true);
  }
  st.recompute = m * layers * rec;
  st.attention = m * layers * attn;
  st.attention_is_compute = j.software.flash_attention;
  // Bubble: (p-1)/v micro-batch times for GPipe / 1F1B / interleaved; zero-bubble (ZB-H1) removes
  // about two thirds of it by filling it with weight-gradient GEMMs (Qi et al. 2023). The slowest stage
  // waits, in warm-up and cool-down, for the others' passes of a micro-batch: with Loom's uneven cut
  // that is the other stages' times, not (p-1) of its own.
  if (l.pp > 1) {
    st.bubble = (l.pp - 1.0) / l.vpp * per_mb;
    if (other_stages) st.bubble = (*other_stages + (l.pp - 1.0) * p2p) / l.vpp;
    if (l.schedule == Schedule::ZeroBubble) st.bubble /= 3;
  }

  // Data-parallel gradient reduction (hierarchical), once per step (per micro-batch for ZeRO-2/3), of the
  // priced (slowest) stage's parameters: with an uneven cut a middle stage may hold more than the last.
  const StageParams sp = stage_params_of(l, j, priced_stage);
  // Loom's engine reduces gradients (and shards ZeRO) over the data replicas dp x cp.
  const GroupShape dpg = j.software.loom_engine ? group(l.dp * l.cp, l.tp, dpn) : group(l.dp, l.tp * l.cp, dpn);
  const GroupShape edpg = group(std::max(1, l.dp / l.ep), l.tp * l.cp * l.ep, dpn);
  // Loom's engine issues one collective per gradient bucket (DDP) or per ZeRO unit and kind, each paying
  // the link's latency: negligible on NVLink, not on a CPU machine whose step's collectives wait ~0.3 ms
  // each for a late peer (calibrated busy; ZeRO-1 on llama-mini measured 29-33 ms of exposed
  // communication against 11-14 ms priced as one reduce-scatter and one gather).
  const double units = layers + (l.pp == 1 ? 2 : 1);  // the blocks, plus the embeddings and / or the head
  auto latency = [&](Collective op, GroupShape g, double count) {
    return j.software.loom_engine && count > 1 ? (count - 1) * group_collective_time(op, 0, g, hw) : 0.0;
  };
  // In bf16 (with f32 masters) the engine gathers each unit's f32-read elements (norms, biases) in a
  // collective of their own beside the bf16 copies: one more latency per unit.
  const bool f32_beside = j.software.loom_engine && j.precision != "f32" && !j.software.bf16_weights_only;
  auto f32_gathers = [&](GroupShape g) {
    return f32_beside ? units * group_collective_time(Collective::AllGather, 0, g, hw) : 0.0;
  };
  auto reduce = [&](double params, GroupShape g) {
    if (g.n <= 1) return 0.0;
    const double grads = params * j.software.grad_bytes;
    if (l.zero == 0) {
      const double buckets = j.software.dp_bucket_bytes > 0 ? std::ceil(grads / j.software.dp_bucket_bytes) : 1;
      return group_collective_time(Collective::AllReduce, grads, g, hw) + latency(Collective::AllReduce, g, buckets);
    }
    const double rs = group_collective_time(Collective::ReduceScatter, grads, g, hw) +
                      latency(Collective::ReduceScatter, g, units);
    // ZeRO-3 keeps no full copy: the next step gathers each unit as it is used (priced below).
    if (l.zero == 3) return m * rs;
    const double ag = group_collective_time(Collective::AllGather, params * 2, g, hw) +  // updated bf16 weights
                      latency(Collective::AllGather, g, units) + f32_gathers(g);
    return (l.zero >= 2 ? m * rs : rs) + ag;
  };
  double dp = reduce(sp.dense, dpg) + reduce(sp.expert, edpg);
  const bool hides = !j.software.comm_on_compute_cores;
  // One micro-batch's forward on the stage (slowed like the rest of the pass: no_recompute_slowdown).
  const double fwd = layers * (lc.gemm + lc.memory + lc.attn_core) *
                     (l.recompute != Recompute::Full ? 1 + j.software.no_recompute_slowdown : 1.0);
  const double window = j.software.dp_overlap && hides ? 2 * fwd : 0;
  st.dp = std::max(0.0, dp - (l.zero >= 2 ? m * window : window));
  double hidden = m * layers * hidden_block;
  // ZeRO-3: weights gathered for every micro-batch's forward and backward, prefetched a unit ahead, and
  // the gradients reduce-scattered as each unit's backward ends. One link carries them all: the
  // forward's gathers run under the forward, and the backward's gathers share the backward (recomputed
  // forward included) with the reduce-scatters. The first unit of each pass has nothing to hide behind.
  if (l.zero == 3) {
    // Experts are sharded over their own replicas (dp / ep), as the memory model holds them.
    double gather = group_collective_time(Collective::AllGather, sp.dense * 2, dpg, hw) +
                    group_collective_time(Collective::AllGather, sp.expert * 2, edpg, hw) +
                    latency(Collective::AllGather, dpg, units);  // per unit, as each block is needed
    gather += f32_gathers(dpg);
    const double rs = dp / m;  // this micro-batch's reduce-scatters
    if (hides) {
      const double bwd = std::max(0.0, per_mb - fwd);
      const double edge = 2 * gather / layers;
      const double gathers_exposed = std::max(0.0, gather - fwd) + std::max(0.0, gather - bwd);
      const double overlapped_rs = j.software.dp_overlap ? rs : 0;
      const double rs_exposed = rs - overlapped_rs + std::max(0.0, gather + overlapped_rs - bwd) - std::max(0.0, gather - bwd);
      st.zero = m * (gathers_exposed + edge);
      st.dp = m * rs_exposed;
      hidden += m * std::max(0.0, 2 * gather + overlapped_rs - gathers_exposed - edge - (rs_exposed - (rs - overlapped_rs)));
    } else {
      st.zero = m * 2 * gather;
      st.dp = dp;
    }
  } else {
    hidden += dp - st.dp;
  }
  // Overlapped communication is not free: the compute under it runs slower by the device's
  // overlap_slowdown (on GPUs, collective kernels take SMs and memory bandwidth from the GEMMs).
  st.overlap = hw.efficiency.overlap_slowdown * hidden;
  // Optimizer step, bytes per local parameter: AdamW streams the fp32 master weight, m and v (read +
  // write: 24), reads the fp32 gradient (4) and writes the bf16 copy (2); gradient-norm clipping reads
  // the gradients once more (4) and the accumulation buffer is zeroed for the next step (4). Counted
  // from Megatron-LM's step (clip_grad_norm, FusedAdam, zero_grad_buffer); Loom's AdamW does the same.
  const double shard = l.zero >= 1 ? l.dp : 1;
  st.memory_bound += (sp.dense + sp.expert) / shard * (engine ? eb.per_local_parameter : 30 + 4 + 4) / bw;
  // fp8: every layer's linear weights cast (and transposed) to fp8 once per step, kept across the
  // micro-batches (read 2 + write 2 bytes an element).
  st.memory_bound += layers * lc.fp8_weights * 4 / bw;

  st.comm_exposed = st.tp + st.cp + st.ep + st.pp + st.dp + st.zero;
  st.total = st.compute + st.memory_bound + st.comm_exposed + st.bubble + st.overlap;
  const double tokens = static_cast<double>(j.global_batch * j.seq);
  st.model_flops = flops_per_token(j.model, j.seq) * tokens;
  st.hardware_flops = (lc.flops * (l.recompute == Recompute::Full ? 4 : 3) * c.n_layers * (m * l.dp * l.cp) +
                       head_flops * m * l.dp * l.cp) * l.tp;
  return st;
}

double tokens_per_s(const StepTime& t, const Job& j) {
  return static_cast<double>(j.global_batch * j.seq) / t.total;
}

double mfu(const StepTime& t, const Job& j) {
  return t.model_flops / (t.total * j.cluster.devices * j.cluster.hw.peak(j.precision));
}

}  // namespace loom::plan
