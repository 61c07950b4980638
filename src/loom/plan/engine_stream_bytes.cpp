#include "loom/plan/engine_stream_bytes.h"

#include <algorithm>
#include <utility>

#include "loom/spec/param_table.h"

namespace loom::plan {

EngineStreamBytes engine_stream_bytes(const spec::TransformerConfig& c, const Layout& l, int64_t seq, bool bf16) {
  const double t = l.tp, n = static_cast<double>(seq) / l.cp * l.micro_batch, h = static_cast<double>(c.d_model);
  const double hd = static_cast<double>(c.head_dim());
  // KV heads that tp does not divide are replicated: each rank then holds one (model/block.h).
  const double kv_heads = static_cast<double>(spec::kv_heads_per_rank(c, l.tp));
  const double q = c.n_heads * hd / t, kv = kv_heads * hd, F = static_cast<double>(c.d_ff) / t;
  const double V = static_cast<double>(c.vocab_size) / t;
  const double norm_rows = l.sp ? n / t : n;
  const bool gpt2 = c.arch == spec::Arch::GPT2;
  const double mlp_out = gpt2 ? F : 2 * F;  // SwiGLU's first linear writes gate and up
  constexpr double f32 = 4;
  // One norm, forward and backward: forward reads x and writes y (and a statistic per row), backward
  // reads x, dy and dx and writes dx; the gains (and LayerNorm's biases) and their gradients once.
  const double norm = gpt2 ? f32 * (6 * norm_rows * h + 7 * h + 4 * norm_rows)
                           : f32 * (6 * norm_rows * h + 4 * h + 2 * norm_rows);
  // A bias gradient reads and writes the bias gradient, and reads dY (in bf16 mode it is summed in the
  // pass that casts dY, which is counted with the casts).
  auto bias_bwd = [&](double width) { return f32 * ((bf16 ? 0 : n * width) + 2 * width); };
  EngineStreamBytes b;
  // The MLP, dense or mixture of experts; `moe_share` of the blocks are MoE blocks (a mean block is
  // priced). Each returns {forward, forward + backward}.
  const double moe_share =
      c.moe.enabled() ? static_cast<double>(c.moe_layer_count()) / static_cast<double>(c.n_layers) : 0;
  const double row_add = 3 * f32 * norm_rows * h;  // a row-parallel sum added to the residual stream
  auto dense_mlp = [&]() -> std::pair<double, double> {
    // The activation (GeLU reads and writes the hidden, backward reads it and dy and writes dx; SwiGLU
    // forward reads gate and up and writes their product, backward reads the two and dy and writes both
    // gradients), the bias gradients of GPT-2's two linears, and under tp the row-parallel sum. In bf16
    // the activation writes its output and its gradient in bf16 directly (the casts for the GEMMs fused
    // in, and GELU's bias gradient summed in its backward), and the down projection's output gradient
    // is cast -- except under zb-h1, whose split backward keeps the f32 gradient and casts it after.
    double fwd = (gpt2 ? 2 : 3) * f32 * n * F, all = (gpt2 ? 2 + 3 : 3 + 5) * f32 * n * F;
    if (gpt2) all += bias_bwd(F) + bias_bwd(h);
    if (bf16 && l.schedule != Schedule::ZeroBubble) {
      fwd = (gpt2 ? 4 + 2 : 8 + 2) * n * F;
      all = fwd + (gpt2 ? 8 + 2 : 12 + 4) * n * F + (4 + 2) * n * h + (gpt2 ? bias_bwd(F) + bias_bwd(h) : 0);
    } else if (bf16) {
      fwd += (4 + 2) * n * F, all += (4 + 2) * n * F + (4 + 2) * n * (mlp_out + h);
    }
    if (l.tp > 1) fwd += row_add, all += row_add;
    return {fwd, all};
  };
  auto moe_mlp = [&]() -> std::pair<double, double> {
    // model/moe_layer.cpp's passes (their bytes as kernels/moe_routing.h declares them), with the
    // routed pairs M = N k (at most each expert's capacity) and, on average over the ep ranks, as many
    // rows on the expert side: routing, the dispatch gather, the experts' SwiGLU (width d_expert / tp),
    // the combine; the shared experts' SwiGLU on every row; the bf16 casts of the hidden and the
    // output gradients; under tp the gathered rows' cast (SP) and the partial sums, under ep the
    // reorders between source and expert order. Backward: the combine's and the router's.
    const double E = static_cast<double>(c.moe.experts), k = static_cast<double>(c.moe.top_k);
    const double Fe = static_cast<double>(c.expert_width()) / t, Fs = static_cast<double>(c.moe.shared_experts) * Fe;
    const double M = std::min(n * k, E * static_cast<double>(c.moe.capacity(static_cast<int64_t>(n)))), R = M;
    const double lp = bf16 ? 2 : 4;
    double fwd = f32 * (2 * n * E + 4 * n * k) + 2 * M * h * lp + 3 * f32 * R * Fe + f32 * (M * h + 2 * n * h + 2 * n * k) +
                 3 * f32 * n * Fs;
    double bwd = f32 * (n * h + 2 * M * h + 3 * n * k) + 5 * f32 * R * Fe + 5 * f32 * n * Fs +
                 f32 * (M * h + 2 * n * h + 2 * n * E + 3 * n * k);
    if (bf16) {
      fwd += (4 + 2) * (R * Fe + n * Fs);
      bwd += (4 + 2) * (R * (h + 2 * Fe) + (Fs > 0 ? n * (h + 2 * Fs) : 0));
    }
    if (l.tp > 1) {
      const double gathered_cast = l.sp && bf16 ? (4 + 2) * n * h : 0;  // again in backward
      fwd += gathered_cast + row_add, bwd += gathered_cast + row_add;
    }
    if (l.ep > 1) fwd += 2 * R * h * (lp + f32), bwd += 2 * 2 * R * h * f32;
    return {fwd, fwd + bwd};
  };
  double mlp_fwd = 0, mlp_all = 0;
  if (moe_share < 1) {
    const auto [f, a] = dense_mlp();
    mlp_fwd += (1 - moe_share) * f, mlp_all += (1 - moe_share) * a;
  }
  if (moe_share > 0) {
    const auto [f, a] = moe_mlp();
    mlp_fwd += moe_share * f, mlp_all += moe_share * a;
  }
  // A block's forward alone (what full recompute runs again): the two norms (read x, write y and the
  // row statistics; the gains and biases once), the MLP's forward, the rotary embedding, the attention's
  // GEMM inputs' casts and, under tp, the attention's row-parallel sum.
  const double norm_fwd = gpt2 ? f32 * (2 * norm_rows * h + 2 * h + 2 * norm_rows) : f32 * (2 * norm_rows * h + h + norm_rows);
  double forward = 2 * norm_fwd + mlp_fwd;
  if (!gpt2) forward += 2 * f32 * n * (q + kv) + f32 * static_cast<double>(seq) / l.cp * hd;
  if (bf16) forward += (4 + 2) * (norm_rows * h + n * q + norm_rows * h);
  if (l.tp > 1) forward += row_add;
  // Selective recompute runs the attention core again (attention, its own class) and casts its output.
  if (l.recompute == Recompute::Full) b.recompute_block = forward;
  if (l.recompute == Recompute::Selective) b.recompute_block = bf16 ? (4 + 2) * n * q : 0;
  b.per_block = 2 * norm + b.recompute_block + mlp_all;
  if (gpt2) {
    // Bias gradients of the attention's two linears (QKV, output projection).
    b.per_block += bias_bwd(q + 2 * kv) + bias_bwd(h);
  } else {
    // RoPE rotates q and k forward and their gradients backward (read + write).
    // The cos/sin table is read once per position (seq / cp positions, head_dim / 2 pairs).
    const double positions = static_cast<double>(seq) / l.cp;
    b.per_block += 2 * 2 * f32 * n * (q + kv) + 2 * f32 * positions * hd;
  }
  if (bf16) {
    // Every linear's input is cast to a bf16 copy (read f32, write bf16) and its output gradient too.
    // Under SP the column-parallel linears' inputs are cast on this rank's rows, then gathered in bf16.
    b.per_block += (4 + 2) * (norm_rows * h + n * q + norm_rows * h);
    b.per_block += (4 + 2) * n * (q + 2 * kv + h);
  }
  // Under tp the attention's output projection sums its partial products over the group into a scratch
  // buffer, then adds it to the residual stream (read two, write one: 12 bytes an element).
  if (l.tp > 1) b.per_block += row_add;
  // Under SP each rank's norms see only its rows: their gain (and bias) gradients are summed into the
  // whole parameter's (an add of h elements each: read two, write one).
  const double norm_grad_sum = l.sp && l.tp > 1 ? 3 * f32 * h * (gpt2 ? 2 : 1) : 0;
  b.per_block += 2 * norm_grad_sum;
  // Embedding lookup and its gradient: the token ids, then rows of the tables read and written.
  b.first_stage = 2 * f32 * (3 * n * h + n);
  // Final norm; the fused softmax cross-entropy reads the logits and writes their gradient (the
  // vocabulary-parallel one takes two passes over the logit shard: partial max and sums, then the
  // gradient after the group's reduction); bf16 casts the head's input and its output gradient.
  b.last_stage = norm + norm_grad_sum + 2 * f32 * n * V * (l.tp > 1 ? 2 : 1) + 2 * f32 * n;
  if (bf16) b.last_stage += (4 + 2) * norm_rows * h + (4 + 2) * n * V;
  // AdamW (kernels/adamw): reads parameter, gradient, m, v and writes parameter, m, v in f32, and the
  // bf16 copy the GEMMs read (declared in both precisions); the gradient norm reads the gradients once
  // more, and the next step's zero_grads writes them.
  b.per_local_parameter = 4 * f32 + 3 * f32 + 2 + f32 + f32;
  return b;
}

}  // namespace loom::plan
