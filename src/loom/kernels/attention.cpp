// Causal self-attention (multi-head and grouped-query): a plain fp32 reference and a blocked,
// FlashAttention-2 style fast version.
//
// Notation (per batch row b and query head h; g = h / (H/KVH) is its key/value head):
//   S[t,t'] = scale * q_t . k_t'            for t' <= t (causal), -inf otherwise
//   P[t,:]  = softmax(S[t,:]),  out_t = sum_t' P[t,t'] v_t',  lse_t = log sum_t' exp(S[t,t'])
// Backward (dO = dout):
//   D_t = dO_t . out_t  (= sum_t' P dP),   dP[t,t'] = dO_t . v_t',   dS = P * (dP - D_t)
//   dq_t = scale * sum_t' dS[t,t'] k_t',  dk_t' = scale * sum_t dS[t,t'] q_t,  dv_t' = sum_t P[t,t'] dO_t
//
// Fast forward. The sequence is cut into tiles of kBlock = 64 queries and 64 keys. One work item is
// (b, h, query tile i); it walks key tiles j = 0..i and keeps, per query row, the running maximum m,
// the running sum l of exp(S - m) and the unnormalised output O (the online softmax): when a new
// tile raises the maximum from m to m', the old l and O are rescaled by exp(m - m'). Only the
// 64 x 64 tile of scores exists at any time, so memory is O(block x (block + D)) per thread whatever
// T is. Tiles above the diagonal are skipped; the diagonal tile masks t' > t. At the end
// out = O / l and lse = m + log(l), which is all backward needs.
//
// Fast backward recomputes P tile by tile from lse (P = exp(S - lse)), so nothing T x T is stored:
//   dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = scale * P * (dP - D_i),  dK_j += dS^T Q_i,  dQ_i += dS K_j
// (five 64 x 64 x D matrix products per tile pair; the forward has two). Every query head of a GQA
// group adds into the same dK/dV head, so work is split so that each output element has exactly one
// owner and a fixed summation order -- no atomics, bitwise reproducible results:
//   * by (b, kv head): one item owns dK/dV of its kv head and dQ of the query heads in its group; it
//     walks key tiles j (outer), the group's heads, then query tiles i >= j, accumulating dQ in a
//     T x D workspace per head. No work is repeated. This needs B*KVH items to keep threads busy.
//   * when B*KVH is too small for the thread count, two passes instead: items (b, kv head, key tile)
//     own dK_j/dV_j; then items (b, h, query tile) recompute S, P, dP and own dQ_i. That repeats two
//     of the five products (7/5 of the work) but scales to any thread count.
// Both schedules visit tile pairs in the same order for every output element (dK/dV: heads of the
// group, then query tiles ascending; dQ: key tiles ascending) with identical arithmetic, so they give
// bitwise identical results: the result does not depend on the thread count.
//
// Inner loops. Operands are read in place from qkv / dout when D is a whole number of 16-float
// vectors; otherwise through copies padded to Dp = D rounded up to 16. Operands that must be read
// across rows (Q in the forward, K and V in the backward) are transposed into D x 64 tiles. Then
// every product is a register-blocked outer-product loop on GCC vector types: a few rows x 4
// vectors of accumulators, one broadcast scalar times one loaded vector per FMA. The code is a
// template on the vector width, instantiated for AVX-512 (16 floats), AVX2 + FMA (8) and SSE2 (4)
// and picked once at run time (the build has no -march flag; one width for all would not do: GCC
// lowers 64-byte vectors on AVX2 through memory, 30x slower). exp is a polynomial (Cephes expf,
// ~2 ulp) on whole vectors.
//
// bf16 (AttentionShape::bf16, what bf16 training asks for): the same items and schedules with bf16
// operands on AVX512-BF16 dot products, in attention_bf16.cpp; on a CPU without them the f32 kernels
// run. Each path can be forced (tests) and capped (LOOM_MAX_CPU_ISA); the choice is one table of entry
// points (KernelSet), so the schedules here are shared by every path.
#include "loom/kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "loom/core/cpu_features.h"
#include "loom/error.h"
#include "loom/kernels/amx_tiles.h"
#include "loom/kernels/detail/attention_bf16.h"
#include "loom/kernels/detail/attention_simd.h"
#include "loom/kernels/detail/attention_tiles.h"

namespace loom::kernels {
namespace {
using namespace attention_detail;

// One set of entry points per ISA; each compiles Simd<W> for its target. Called once per work item
// through the table picked below (a pointer call per item costs nothing next to the item).
struct KernelSet {
  void (*forward_query_tile)(const Dims&, float*, float*, const float*, int64_t, int64_t, int64_t, float*);
  void (*backward_key_tiles)(const Dims&, const BackwardArgs&, int64_t, int64_t, int64_t, int64_t, float*, float*,
                             float*);
  void (*backward_query_tile)(const Dims&, const BackwardArgs&, int64_t, int64_t, int64_t, float*);
  int64_t (*forward_workspace)(int64_t Dp);                    // floats per thread
  int64_t (*backward_tiles)(const Dims&, bool by_kv_head);     // floats per thread, besides dQ / D_t
  // Optional: operands the forward packs once per call (into Dims::packed) before any query tile.
  int64_t (*forward_packed)(const Dims&) = nullptr;            // floats
  int64_t (*forward_pack_tasks)(const Dims&) = nullptr;
  void (*forward_pack)(const Dims&, const float* qkv, float* packed, int64_t task) = nullptr;
};

constexpr int64_t f32_backward_tiles(const Dims& s, bool) { return backward_tile_floats(s.Dp); }

#define LOOM_ATTN_KERNEL_SET(name, target_attr, W)                                                                   \
  target_attr void name##_forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b,     \
                                             int64_t h, int64_t i, float* ws) {                                      \
    Simd<W>::forward_query_tile(s, out, lse, qkv, b, h, i, ws);                                                      \
  }                                                                                                                  \
  target_attr void name##_backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g,             \
                                             int64_t j_begin, int64_t j_end, float* dQ, float* Di, float* ws) {      \
    Simd<W>::backward_key_tiles(s, a, b, g, j_begin, j_end, dQ, Di, ws);                                             \
  }                                                                                                                  \
  target_attr void name##_backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i, \
                                              float* ws) {                                                           \
    Simd<W>::backward_query_tile(s, a, b, h, i, ws);                                                                 \
  }                                                                                                                  \
  constexpr KernelSet name##_kernels{name##_forward_query_tile, name##_backward_key_tiles,                          \
                                     name##_backward_query_tile, forward_workspace_floats, f32_backward_tiles};

LOOM_ATTN_KERNEL_SET(avx512, __attribute__((target("avx512f,fma"))), 16)
LOOM_ATTN_KERNEL_SET(avx2, __attribute__((target("avx2,fma"))), 8)
LOOM_ATTN_KERNEL_SET(sse2, , 4)
// attention_bf16.cpp: compiled for AVX512-BF16 as a whole.
constexpr KernelSet bf16_avx512_kernels{bf16_forward_query_tile,       bf16_backward_key_tiles,
                                        bf16_backward_query_tile,      bf16_forward_workspace_floats,
                                        bf16_backward_tile_floats,     bf16_forward_packed_floats,
                                        bf16_forward_pack_tasks,       bf16_forward_pack};
constexpr KernelSet bf16_amx_kernels{amx_forward_query_tile,        amx_backward_key_tiles,
                                     amx_backward_query_tile,       bf16_forward_workspace_floats,
                                     bf16_backward_tile_floats,     bf16_forward_packed_floats,
                                     bf16_forward_pack_tasks,       tiles_forward_pack};
constexpr KernelSet bf16_soft_amx_kernels{soft_amx_forward_query_tile,   soft_amx_backward_key_tiles,
                                          soft_amx_backward_query_tile,  bf16_forward_workspace_floats,
                                          bf16_backward_tile_floats,     bf16_forward_packed_floats,
                                          bf16_forward_pack_tasks,       tiles_forward_pack};

KernelIsa isa_needed(AttentionPath p) {
  switch (p) {
    case AttentionPath::F32Sse2: return KernelIsa::Sse2;
    case AttentionPath::F32Avx2: return KernelIsa::Avx2;
    case AttentionPath::F32Avx512: return KernelIsa::Avx512;
    case AttentionPath::Bf16Avx512: return KernelIsa::Avx512Bf16;
    case AttentionPath::Bf16SoftwareAmx: return KernelIsa::Avx512Bf16;  // the tiles are emulated
    case AttentionPath::Bf16Amx: break;
  }
  return KernelIsa::Amx;
}

// The path a call runs: the one asked for (refused if this CPU cannot run it), else the best for
// the precision.
AttentionPath resolve(const AttentionShape& s, std::optional<AttentionPath> forced, const char* op) {
  if (!forced) return attention_path(s.bf16);
  if (!attention_path_supported(*forced))
    throw Error(std::string(op) + ": the " + attention_path_name(*forced) + " path needs " +
                kernel_isa_name(isa_needed(*forced)) + ", and this CPU (capped by LOOM_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) " +
                "offers " + kernel_isa_name(CpuFeatures::detect().kernel_isa()) +
                (*forced == AttentionPath::Bf16Amx ? " (AMX tiles: " + amx_tiles_status().detail + ")" : ""));
  return *forced;
}

const KernelSet& kernels(AttentionPath p) {
  switch (p) {
    case AttentionPath::Bf16Avx512: return bf16_avx512_kernels;
    case AttentionPath::Bf16Amx: return bf16_amx_kernels;
    case AttentionPath::Bf16SoftwareAmx: return bf16_soft_amx_kernels;
    case AttentionPath::F32Avx512: return avx512_kernels;
    case AttentionPath::F32Avx2: return avx2_kernels;
    case AttentionPath::F32Sse2: break;
  }
  return sse2_kernels;
}

// The by-kv-head schedule keeps dQ of a whole group (group x T x D floats) per thread (and the bf16
// kernels their item's packed operands, ~2x that). Past this size
// (e.g. T = 32K, D = 128, group 4) the two-pass schedule, whose workspace does not grow with T, is
// used instead: very long sequences pay 2/5 more work rather than a workspace the size of the
// activations per thread.
constexpr int64_t kMaxDqWorkspaceBytes = int64_t{64} << 20;

// Chooses the by-kv-head schedule unless too few items would leave threads idle for longer than the
// two-pass schedule's extra 2/5 of work costs (compare ceil(items/threads) against 7/5 *
// items/threads), or its dQ workspace would be too large.
bool backward_by_kv_head(int64_t items, int64_t threads, int64_t dq_bytes) {
  const int64_t rounds = (items + threads - 1) / threads;
  return 5 * rounds * threads <= 7 * items && dq_bytes <= kMaxDqWorkspaceBytes;
}

constexpr int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }


}  // namespace

const char* attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::F32Sse2: return "f32 (sse2)";
    case AttentionPath::F32Avx2: return "f32 (avx2)";
    case AttentionPath::F32Avx512: return "f32 (avx512)";
    case AttentionPath::Bf16Avx512: return "bf16 dot products (avx512_bf16)";
    case AttentionPath::Bf16Amx: return "bf16 tiles (amx) and dot products (avx512_bf16)";
    case AttentionPath::Bf16SoftwareAmx: return "bf16 software tiles (tests) and dot products (avx512_bf16)";
  }
  return "?";
}

bool attention_path_supported(AttentionPath p) {
  if (isa_needed(p) > CpuFeatures::detect().kernel_isa()) return false;
  return p != AttentionPath::Bf16Amx || amx_tiles_status().ready;
}

AttentionPath attention_path(bool bf16) {
  const KernelIsa isa = CpuFeatures::detect().kernel_isa();
  if (bf16 && isa >= KernelIsa::Amx && amx_tiles_status().ready) return AttentionPath::Bf16Amx;
  if (bf16 && isa >= KernelIsa::Avx512Bf16) return AttentionPath::Bf16Avx512;
  if (isa >= KernelIsa::Avx512) return AttentionPath::F32Avx512;
  if (isa >= KernelIsa::Avx2) return AttentionPath::F32Avx2;
  return AttentionPath::F32Sse2;
}

namespace {

// One forward call's work, self-attention or a block (the Dims say which).
void run_forward(Dims s, const KernelSet& kern, float* out, float* lse, const float* qkv, Allocator& alloc) {
  const int threads = std::max(1, omp_get_max_threads());
  Buffer packed;
  if (kern.forward_pack != nullptr) {
    packed = Buffer(alloc, static_cast<size_t>(kern.forward_packed(s)) * sizeof(float), MemCategory::Workspace);
    float* p = static_cast<float*>(packed.data());
    const int64_t tasks = kern.forward_pack_tasks(s);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) kern.forward_pack(s, qkv, p, t);
    s.packed = p;
  }
  const int64_t per_thread = kern.forward_workspace(s.Dp);
  Buffer ws(alloc, static_cast<size_t>(threads * per_thread) * sizeof(float), MemCategory::Workspace);
  float* ws_base = static_cast<float*>(ws.data());
  const int64_t heads = s.B * s.H, items = heads * s.tiles;
  // Item k = (query tile, b*h) with the last (longest: i+1 key tiles) query tiles first, handed out
  // one at a time, so the causal triangle's uneven rows do not leave a thread idle at the end.
#pragma omp parallel num_threads(threads)
  {
    float* mine = ws_base + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < items; ++k) {
      const int64_t i = s.tiles - 1 - k / heads, bh = k % heads;
      kern.forward_query_tile(s, out, lse, qkv, bh / s.H, bh % s.H, i, mine);
    }
  }
}

void run_backward(const Dims& s, const KernelSet& kern, const BackwardArgs& a, Allocator& alloc) {
  const int threads = std::max(1, omp_get_max_threads());
  const int64_t kv_heads = s.B * s.KVH;
  // The by-kv-head item's own workspace: dQ of its group, and whatever its kernels pack up front.
  const int64_t item_bytes =
      (s.group * s.T * s.Dp + kern.backward_tiles(s, true) - kern.backward_tiles(s, false)) * int64_t{sizeof(float)};
  const bool by_kv_head = backward_by_kv_head(kv_heads, threads, item_bytes);
  const int64_t dq_floats = by_kv_head ? s.group * s.T * s.Dp : 0;
  const int64_t di_floats = by_kv_head ? round_up(s.group * s.T, kPad) : 0;
  const int64_t tile_floats = kern.backward_tiles(s, by_kv_head);
  const int64_t per_thread = tile_floats + dq_floats + di_floats;
  Buffer ws(alloc, static_cast<size_t>(threads * per_thread) * sizeof(float), MemCategory::Workspace);
  float* ws_base = static_cast<float*>(ws.data());

  if (by_kv_head) {
#pragma omp parallel num_threads(threads)
    {
      float* mine = ws_base + omp_get_thread_num() * per_thread;
      float* dQ = mine + tile_floats;
      float* Di = dQ + dq_floats;
#pragma omp for schedule(dynamic, 1)
      for (int64_t k = 0; k < kv_heads; ++k)
        kern.backward_key_tiles(s, a, k / s.KVH, k % s.KVH, 0, s.ktiles, dQ, Di, mine);
    }
    return;
  }
  // Two passes. Item k of the first = (key tile j, b*kv head), smallest j (most query tiles) first;
  // of the second = (query tile i, b*h), largest i (most key tiles) first. The passes write disjoint
  // columns (dK, dV vs dQ) from the same inputs, so threads go on to the second without a barrier.
  const int64_t heads = s.B * s.H;
#pragma omp parallel num_threads(threads)
  {
    float* mine = ws_base + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t k = 0; k < kv_heads * s.ktiles; ++k) {
      const int64_t j = k / kv_heads, bg = k % kv_heads;
      kern.backward_key_tiles(s, a, bg / s.KVH, bg % s.KVH, j, j + 1, nullptr, nullptr, mine);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < heads * s.tiles; ++k) {
      const int64_t i = s.tiles - 1 - k / heads, bh = k % heads;
      kern.backward_query_tile(s, a, bh / s.H, bh % s.H, i, mine);
    }
  }
}

void validate_block(const AttentionShape& s, int64_t Tk, const char* op) {
  validate(s, op);
  if (Tk <= 0) throw ShapeError(std::string(op) + ": the key block must hold at least one token (Tk = " + std::to_string(Tk) + ")");
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, const AttentionShape& shape, Allocator& alloc,
                       std::optional<AttentionPath> path) {
  validate(shape, "attention_forward");
  run_forward(make_dims(shape), kernels(resolve(shape, path, "attention_forward")), out, lse, qkv, alloc);
}

void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        const AttentionShape& shape, Allocator& alloc, std::optional<AttentionPath> path) {
  validate(shape, "attention_backward");
  run_backward(make_dims(shape), kernels(resolve(shape, path, "attention_backward")),
               BackwardArgs{dqkv, dout, out, lse, qkv, qkv, dqkv}, alloc);
}

void attention_block_forward(float* out, float* lse, const float* q, const float* kv, int64_t Tk,
                             const AttentionShape& shape, Allocator& alloc, std::optional<AttentionPath> path) {
  validate_block(shape, Tk, "attention_block_forward");
  Dims s = make_block_dims(shape, Tk);
  s.kv = kv;
  run_forward(s, kernels(resolve(shape, path, "attention_block_forward")), out, lse, q, alloc);
}

void attention_block_backward(float* dq, float* dkv, const float* dout, const float* out, const float* lse,
                              const float* q, const float* kv, int64_t Tk, const AttentionShape& shape,
                              Allocator& alloc, std::optional<AttentionPath> path) {
  validate_block(shape, Tk, "attention_block_backward");
  run_backward(make_block_dims(shape, Tk), kernels(resolve(shape, path, "attention_block_backward")),
               BackwardArgs{dq, dout, out, lse, q, kv, dkv}, alloc);
}

// FLOPs count multiply and add as 2 and only the causal pairs t' <= t, T(T+1)/2 per (b, h):
//   forward  = S = Q K^T and O = P V:                  2 products * 2 D flops per pair = 4 D
//   backward = S (recomputed), dP = dO V^T, dV = P^T dO,
//              dK = dS^T Q, dQ = dS K:                 5 products * 2 D flops per pair = 10 D
// so backward = 2.5 x forward. The exp, max and scaling work (O(pairs), not O(pairs * D)) is left
// out, as is the 2/5 extra recompute of the two-pass backward schedule (used only when B*KVH is small
// next to the thread count, or T very long). Bytes: each tensor read or written once (tiles re-read
// from cache are not counted).
KernelCost attention_cost(const AttentionShape& s, bool backward) {
  const double pairs = static_cast<double>(s.T) * static_cast<double>(s.T + 1) / 2.0;
  const double heads = static_cast<double>(s.B) * static_cast<double>(s.H);
  const double forward_flops = heads * pairs * static_cast<double>(s.D) * 4.0;
  const double tokens = static_cast<double>(s.B) * static_cast<double>(s.T);
  const double qkv_bytes = tokens * static_cast<double>((s.H + 2 * s.KVH) * s.D) * sizeof(float);
  const double out_bytes = tokens * static_cast<double>(s.H * s.D) * sizeof(float);
  const double lse_bytes = heads * static_cast<double>(s.T) * sizeof(float);
  KernelCost c;
  if (!backward) {
    c.flops = forward_flops;
    c.bytes = qkv_bytes + out_bytes + lse_bytes;  // read qkv; write out, lse
  } else {
    c.flops = 2.5 * forward_flops;
    c.bytes = 2 * qkv_bytes + 2 * out_bytes + lse_bytes;  // read qkv, out, dout, lse; write dqkv
  }
  return c;
}


KernelCost attention_block_cost(const AttentionShape& s, int64_t Tk, bool backward) {
  const double pairs = static_cast<double>(s.T) * static_cast<double>(Tk);
  const double heads = static_cast<double>(s.B) * static_cast<double>(s.H);
  const double forward_flops = heads * pairs * static_cast<double>(s.D) * 4.0;
  const double q_bytes = static_cast<double>(s.B * s.T * s.H * s.D) * sizeof(float);  // q, out, dout, dq alike
  const double kv_bytes = static_cast<double>(s.B * Tk * 2 * s.KVH * s.D) * sizeof(float);
  const double lse_bytes = heads * static_cast<double>(s.T) * sizeof(float);
  KernelCost c;
  c.flops = backward ? 2.5 * forward_flops : forward_flops;
  c.bytes = backward ? 4 * q_bytes + 2 * kv_bytes + lse_bytes : 2 * q_bytes + kv_bytes + lse_bytes;
  return c;
}

}  // namespace loom::kernels
