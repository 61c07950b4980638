// Causal self-attention, multi-head and grouped-query, computed in blocks with an online softmax
// (FlashAttention-2 style): the T x T score matrix is never materialised. Forward saves only the
// output and the per-row log-sum-exp; backward recomputes the probabilities block by block.
// Workspace is O(T x block) per thread, drawn from the Allocator (category Workspace) so tests can
// check the peak.
//
// Layout: qkv is [B, T, (H + 2*KVH) * D] row-major (one row per token: H query heads, then KVH key
// heads, then KVH value heads, each D wide) -- exactly the output of the fused QKV projection.
// Query head h reads key/value head h / (H / KVH). out is [B, T, H * D]; lse is [B, H, T].
#pragma once

#include <cstdint>

#include "loom/core/allocator.h"
#include "loom/kernels/kernel_cost.h"

namespace loom::kernels {

struct AttentionShape {
  int64_t B = 1, T = 1, H = 1, KVH = 1, D = 1;
  float scale = 0;  // usually 1/sqrt(D)
};

void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& s, Allocator& alloc);
// Writes (does not accumulate) dqkv for all q, k and v columns.
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& s, Allocator& alloc);
KernelCost attention_cost(const AttentionShape& s, bool backward);

namespace ref {
// Plain fp32 reference: materialises each row's scores; same layout and conventions.
void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& s);
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& s);
}  // namespace ref

}  // namespace loom::kernels
