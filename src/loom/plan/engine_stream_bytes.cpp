#include "loom/plan/engine_stream_bytes.h"

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
  // A block's forward alone (what full recompute runs again): the two norms (read x, write y and the
  // row statistics; the gains and biases once), the activation, the rotary embedding, the GEMM inputs'
  // casts and, under tp, the row-parallel sums.
  const double norm_fwd = gpt2 ? f32 * (2 * norm_rows * h + 2 * h + 2 * norm_rows) : f32 * (2 * norm_rows * h + h + norm_rows);
  double forward = 2 * norm_fwd + (gpt2 ? 2 : 3) * f32 * n * F;
  if (!gpt2) forward += 2 * f32 * n * (q + kv) + f32 * static_cast<double>(seq) / l.cp * hd;
  if (bf16) forward += (4 + 2) * (norm_rows * h + n * q + norm_rows * h + n * F);
  if (l.tp > 1) forward += 2 * 3 * f32 * norm_rows * h;
  // Selective recompute runs the attention core again (attention, its own class) and casts its output.
  if (l.recompute == Recompute::Full) b.recompute_block = forward;
  if (l.recompute == Recompute::Selective) b.recompute_block = bf16 ? (4 + 2) * n * q : 0;
  b.per_block = 2 * norm + b.recompute_block;
  if (gpt2) {
    // GeLU: forward reads and writes the hidden, backward reads it and dy and writes dx.
    b.per_block += (2 + 3) * f32 * n * F;
    // Bias gradients of the four linears (QKV, output projection, MLP in and out).
    b.per_block += bias_bwd(q + 2 * kv) + bias_bwd(h) + bias_bwd(F) + bias_bwd(h);
  } else {
    // SwiGLU: forward reads gate and up and writes their product; backward reads the two and dy and
    // writes both gradients. RoPE rotates q and k forward and their gradients backward (read + write).
    b.per_block += (3 + 5) * f32 * n * F;
    // The cos/sin table is read once per position (seq / cp positions, head_dim / 2 pairs).
    const double positions = static_cast<double>(seq) / l.cp;
    b.per_block += 2 * 2 * f32 * n * (q + kv) + 2 * f32 * positions * hd;
  }
  if (bf16) {
    // Every linear's input is cast to a bf16 copy (read f32, write bf16) and its output gradient too.
    // Under SP the column-parallel linears' inputs are cast on this rank's rows, then gathered in bf16.
    b.per_block += (4 + 2) * (norm_rows * h + n * q + norm_rows * h + n * F);
    b.per_block += (4 + 2) * n * (q + 2 * kv + h + mlp_out + h);
  }
  if (l.tp > 1) {
    // Row-parallel linears (attention output, MLP out) sum their partial products over the group into a
    // scratch buffer, then add it to the residual stream (read two, write one: 12 bytes an element).
    b.per_block += 2 * 3 * f32 * norm_rows * h;
  }
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
  // bf16 copy the GEMMs read (declared in both precisions).
  b.per_local_parameter = 4 * f32 + 3 * f32 + 2;
  return b;
}

}  // namespace loom::plan
