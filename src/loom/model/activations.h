// Per-micro-batch activation context: everything a forward pass saves for its backward pass, plus
// the backward pass's scratch. One context per micro-batch in flight (a pipeline schedule keeps
// several; plain gradient accumulation reuses one). All tensors are accounted as Activations.
#pragma once

#include <vector>

#include "loom/core/tensor.h"
#include "loom/spec/recompute.h"

namespace loom::model {

// What a mixture-of-experts block's MLP saves (model/moe_layer.h). Rows "in expert order" are the
// (token, slot) pairs each expert took, expert after expert: at most N k of them.
struct MoeActivations {
  Tensor scores;                 // [N, E] router scores (softmax or sigmoid)
  Tensor expert, weight, row;    // [N, k]: I32 chosen experts, f32 combine weights, I32 row (-1: dropped)
  Tensor token_of_row;           // I32 [N k]
  std::vector<int64_t> routed;   // [E] pairs routed to each expert before capacity (the aux loss's counts)
  std::vector<int64_t> offsets;  // [E + 1] each expert's rows
  Tensor x;                      // [N k, C] the experts' inputs in expert order (GEMM precision)
  Tensor y;                      // [N k, C] the experts' outputs, unweighted
  // Expert side: the rows this rank's experts run (its own under ep = 1; under expert parallelism the
  // rows every ep rank sent them, at most ep N k), expert after expert.
  Tensor xe;                     // [rows, C] their inputs (x itself at ep = 1)
  Tensor h_pre;                  // [rows, 2 Fe] gate|up
  Tensor h_act, h_act_lp;        // [rows, Fe]
  // Expert parallelism: every ep rank's per-expert row counts [ep x E], the rows sent to / received from
  // each ep rank, this rank's experts' rows (offsets over its experts), and the order between rows as
  // received (by source rank) and as run (by expert): received row perm[q] is run as row q, inv its inverse.
  std::vector<int64_t> counts_all, send_rows, recv_rows, local_offsets;
  std::vector<int32_t> perm, inv;
  Tensor shared_pre, shared_act, shared_act_lp;  // the shared experts: [N, 2 Fs], [N, Fs] (undefined: none)
};

// The backward scratch of a mixture-of-experts MLP, shared by all blocks.
struct MoeScratch {
  Tensor dy, dx;             // [N k, C] in expert order
  Tensor d_act, d_pre;       // [rows, Fe], [rows, 2 Fe] (expert side)
  // Expert parallelism: rows as received from the ep ranks (inputs in GEMM precision; f32 outputs and
  // gradients) and as run by expert, [ep N k, C] each.
  Tensor recv_lp, recv, by_expert;
  Tensor dweight, dlogits;   // [N, k], [N, E]
  Tensor shared_d_act, shared_d_pre;  // [N, Fs], [N, 2 Fs]
  // Tensor parallelism: this rank's partial output (forward) or input gradient (backward) [N, C], summed
  // over the group; under sequence parallelism also the gathered inputs (f32 and GEMM precision) and
  // output gradient [N, C].
  Tensor partial, x_whole, x_whole_lp, dout_whole;
};

// What one transformer block saves. Names follow the block's data flow:
// x_in -> norm1 -> qkv -> attention -> att -> out-proj (+x_in) -> x_mid -> norm2 -> h_pre -> act -> h_act
// -> down-proj (+x_mid) -> x_out. `*_lp` are bf16 copies used as GEMM inputs in bf16 mode (else
// they alias the f32 tensor); in bf16 mode n1_out, n2_out and h_act are views of one scratch shared by
// all layers (only their bf16 copies are saved).
struct BlockActivations {
  Tensor n1_mean, n1_rstd, n1_out, n1_lp;
  Tensor qkv;       // [N, (H + 2 KVH) * D], rotary already applied to q and k
  Tensor lse;       // [B, H, T]
  Tensor att, att_lp;  // [N, H * D]
  Tensor x_mid;     // [N, C]
  Tensor n2_mean, n2_rstd, n2_out, n2_lp;
  Tensor h_pre;     // [N, F] (GPT-2) or [N, 2F] gate|up (Llama)
  Tensor h_act, h_act_lp;  // [N, F]
  MoeActivations moe;      // a mixture-of-experts block's MLP instead of h_pre / h_act
};

// Split backward (zero-bubble schedules): the output gradients of a block's four linears, kept from its
// input-gradient pass until its weight-gradient pass. [N, C] ones hold this rank's rows of the residual
// stream's gradient.
struct BlockOutputGrads {
  Tensor down;  // [N, C]: d(loss)/d(x_out), the MLP down-projection's dy
  Tensor up;    // [N, F] or [N, 2F]: the up (gate|up) projection's dy
  Tensor out;   // [N, C]: the attention output projection's dy
  Tensor qkv;   // [N, (H + 2 KVH) * D]
};

struct ActivationContext {
  int64_t B = 0, T = 0;
  // What the blocks keep (spec/recompute.h). Selective: every block's att, att_lp and lse are views of
  // one set that backward refills per block. Full: every block's BlockActivations are views of one
  // block's worth that backward refills, the block's output going to recompute_out.
  spec::Recompute recompute = spec::Recompute::None;
  Tensor recompute_out;                  // full: [N, C] (this rank's rows under SP)
  Tensor tokens, targets;                // I32 [B, T]
  // Under sequence parallelism every [N, C] of the residual stream below (residual, the norms' tensors,
  // x_mid, d_res, d_norm) holds this rank's N / tp rows.
  std::vector<Tensor> residual;          // L + 1 tensors [N, C]: input of each block, then the last output
  std::vector<BlockActivations> blocks;  // L
  Tensor nf_mean, nf_rstd, nf_out, nf_lp;  // final norm
  Tensor logits;                         // [N, V]; holds dlogits after a training forward
  Tensor losses;                         // [N]
  // Backward scratch, shared by all blocks.
  Tensor d_res, d_norm, d_att, d_qkv, d_h_act, d_h_pre;
  MoeScratch moe;  // when the chunk has a mixture-of-experts block
  // The weight of each mixture-of-experts block's load-balancing loss in this micro-batch's gradient:
  // aux_loss_coef x its share of the step's tokens (0 in evaluation).
  double moe_aux_scale = 0;
  // Under sequence parallelism: one block's partial norm gradients [4 C] before they are summed over
  // the group (undefined otherwise).
  Tensor norm_grads;
  // Split backward only: per block of the chunk (L entries, the chunk's defined), its linears' output
  // gradients between the input- and the weight-gradient pass.
  std::vector<BlockOutputGrads> split;
  // precision = "fp8": a linear's quantised output gradient, one linear at a time (the largest of them).
  Tensor fp8_dy;
  int64_t valid_targets = 0;             // targets >= 0 in this micro-batch
  // Context parallelism (cp > 1): the global positions of the T tokens this rank holds of each sample,
  // the rotary tables' rows at those positions (Llama), and the learned positions' rows gathered for the
  // embedding and their gradient before it is added back at those rows (GPT-2). Empty at cp = 1, where
  // the positions are 0 .. T-1 and the model's own tables are read.
  std::vector<int32_t> positions;
  Tensor rope_cos, rope_sin;
  Tensor wpe_rows, dwpe_rows;
};

}  // namespace loom::model
