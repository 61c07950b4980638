// The token-routing kernels of a mixture-of-experts block (model/moe_layer.h runs them around the
// experts' GEMMs): router scores and top-k, the assignment of (token, slot) pairs to rows of
// expert-sorted buffers under a capacity, and the gathers and weighted sums that move rows between token
// order and expert order, with their backward passes. Raw f32 pointers, llm.c style; N tokens, E
// experts, k slots per token, C channels, M = rows in expert order (at most N k).
#pragma once

#include <cstdint>
#include <vector>

#include "loom/spec/transformer_config.h"

namespace loom::kernels {

// Router: `scores` [N, E] holds the router's logits on entry and its scores on return (softmax over the
// experts, or an independent sigmoid). Each token's k experts are those with the largest score + bias
// (bias [E] only chooses, DeepSeek-V3's auxiliary-loss-free balancing; nullptr: none; ties go to the
// lower expert), written to expert [N, k] in descending order, and their combine weights, the chosen
// scores (divided by their sum when `normalize`), to weight [N, k].
void moe_route_forward(float* scores, int32_t* expert, float* weight, const float* bias, int64_t N, int64_t E,
                       int64_t k, spec::RouterScore score, bool normalize);

// The per-expert load of one routing, and where each (token, slot) goes.
struct MoeAssignment {
  std::vector<int64_t> routed;   // [E] pairs routed to each expert (before capacity drops)
  std::vector<int64_t> offsets;  // [E + 1] expert e's rows are [offsets[e], offsets[e + 1])
  int64_t dropped = 0;           // pairs past their expert's capacity
};
// Places every (token t, slot j) pair at a row of the expert-sorted buffers: row [N, k] (-1: dropped)
// and token_of_row [N k] (the first offsets[E] entries are used). Each expert keeps at most `capacity`
// pairs, taken slot by slot (every token's first choice before any second choice) and by token within
// a slot, as GShard and Switch do; within an expert, rows follow token order.
MoeAssignment moe_assign_rows(int32_t* row, int32_t* token_of_row, const int32_t* expert, int64_t N, int64_t E,
                              int64_t k, int64_t capacity);

// dst[r, :] = src[token_of_row[r], :] for r < M; `bytes_per_row` of any dtype.
void moe_gather_rows(void* dst, const void* src, const int32_t* token_of_row, int64_t M, int64_t bytes_per_row);
// out[t, :] += sum_j weight[t, j] * y[row[t, j], :] over kept slots.
void moe_combine_forward(float* out, const float* y, const int32_t* row, const float* weight, int64_t N, int64_t k,
                         int64_t C);
// The combine's backward: dy[row[t, j], :] = weight[t, j] * dout[t, :] and dweight[t, j] = <dout[t, :],
// y[row[t, j], :]> (0 for a dropped slot).
void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const int32_t* row,
                          const float* weight, int64_t N, int64_t k, int64_t C);
// dx[t, :] += sum_j dx_rows[row[t, j], :] over kept slots (the gather's backward, per token: no races).
void moe_scatter_add_rows(float* dx, const float* dx_rows, const int32_t* row, int64_t N, int64_t k, int64_t C);

// The Switch-style load-balancing loss E / (N k) sum_e routed_e P_e, P_e the mean over tokens of the
// expert's probability (the softmax score, or the sigmoid scores divided by their sum per token).
double moe_aux_loss(const float* scores, const std::vector<int64_t>& routed, int64_t N, int64_t E, int64_t k,
                    spec::RouterScore score);
// The router's backward: dlogits [N, E] (written) from d(loss)/d(weight) [N, k], plus `aux_scale` times
// the load-balancing loss's gradient (routed counts held constant, as in Switch). scores, expert and
// weight as moe_route_forward left them.
void moe_route_backward(float* dlogits, const float* dweight, const float* scores, const int32_t* expert,
                        const float* weight, const std::vector<int64_t>& routed, double aux_scale, int64_t N, int64_t E,
                        int64_t k, spec::RouterScore score, bool normalize);

// The bytes each pass moves, as its trace span declares them (plan/engine_stream_bytes.cpp counts the
// same for the planner): routing reads and rewrites the scores [N, E] and writes the choices, weights,
// row plan [N, k] and token_of_row; a gather reads and writes its M rows; the combine reads M output
// rows and reads and writes N token rows (with the slots' weights and rows); its backward reads the N
// token gradients and M output rows and writes M row gradients; the router's backward scatters M row
// gradients into N token rows and reads the scores to write their gradient. f32 throughout.
double moe_route_bytes(int64_t N, int64_t E, int64_t k);
double moe_gather_bytes(int64_t M, int64_t bytes_per_row);
double moe_combine_bytes(int64_t N, int64_t M, int64_t C, int64_t k);
double moe_combine_backward_bytes(int64_t N, int64_t M, int64_t C, int64_t k);
double moe_route_backward_bytes(int64_t N, int64_t M, int64_t C, int64_t E, int64_t k);

}  // namespace loom::kernels
