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
#include <optional>

#include "loom/core/allocator.h"
#include "loom/kernels/kernel_cost.h"

namespace loom::kernels {

struct AttentionShape {
  int64_t B = 1, T = 1, H = 1, KVH = 1, D = 1;
  float scale = 0;  // usually 1/sqrt(D)
  // bf16 training: Q, K, V and dO are rounded to bf16 as tiles are loaded, and so are the
  // probabilities and dS before they multiply V, dO, Q and K; products accumulate and the softmax
  // statistics stay in f32 (FlashAttention-2's mixed precision). Where the CPU has no bf16 dot
  // products the f32 kernels run instead. Inputs and outputs stay f32 either way.
  bool bf16 = false;
};

// The instruction paths, each forced by passing it (tests), else picked from the CPU capped by
// LOOM_MAX_CPU_ISA / DNNL_MAX_CPU_ISA (CpuFeatures::kernel_isa) and the shape's precision.
// Bf16Amx: the bf16 kernels with their score and dQ products on AMX tiles (where amx_tiles_status()
// is ready). Bf16SoftwareAmx: the same code on a software tile unit -- slow, never chosen by
// attention_path(); it exists so tests check the AMX kernels' layouts on any AVX512-BF16 CPU.
enum class AttentionPath { F32Sse2, F32Avx2, F32Avx512, Bf16Avx512, Bf16Amx, Bf16SoftwareAmx };
const char* attention_path_name(AttentionPath p);  // e.g. "bf16 dot products (avx512_bf16)"
AttentionPath attention_path(bool bf16);            // what a call with that precision runs here
bool attention_path_supported(AttentionPath p);     // whether this CPU (and the ISA cap) can run p

// `path` forces an instruction path (refused with an error if the CPU cannot run it).
void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& s, Allocator& alloc,
                       std::optional<AttentionPath> path = std::nullopt);
// Writes (does not accumulate) dqkv for all q, k and v columns.
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& s, Allocator& alloc, std::optional<AttentionPath> path = std::nullopt);
KernelCost attention_cost(const AttentionShape& s, bool backward);

// A block of attention without a mask (context parallelism's ring: queries against the keys of another
// rank's tokens that all precede them): s.T queries q [B, T, H D] against Tk keys and values
// kv [B, Tk, 2 KVH D] (each row: KVH key heads, then KVH value heads); out [B, T, H D], lse [B, H, T]
// as above. Backward takes the final out and lse of the queries' rows (over every block they attend
// to, so P is the true softmax), and writes dq [B, T, H D] and dkv [B, Tk, 2 KVH D] (this block's
// share of the key/value gradients). Runs on the path s.bf16 picks, as self-attention does.
void attention_block_forward(float* out, float* lse, const float* q, const float* kv, int64_t Tk,
                             const AttentionShape& s, Allocator& alloc, std::optional<AttentionPath> path = std::nullopt);
void attention_block_backward(float* dq, float* dkv, const float* dout, const float* out, const float* lse,
                              const float* q, const float* kv, int64_t Tk, const AttentionShape& s, Allocator& alloc,
                              std::optional<AttentionPath> path = std::nullopt);
// Every one of the T x Tk pairs counts (no causal half).
KernelCost attention_block_cost(const AttentionShape& s, int64_t Tk, bool backward);

namespace ref {
// Plain fp32 reference: materialises each row's scores; same layout and conventions.
void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& s);
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& s);
}  // namespace ref

}  // namespace loom::kernels
