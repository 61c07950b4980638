// Fast embedding, bias gradient, reductions (sum of squares, non-finite search), casts and add.
// The other element-wise families live in norms.cpp, activations.cpp, rope.cpp, loss.cpp and
// optimizer_kernels.cpp; the plain references of all of them in elementwise_ref.cpp.
#include <array>
#include <cstring>
#include <vector>

#include "loom/core/philox.h"
#include "loom/kernels/detail/elementwise_avx512.h"
#include "loom/kernels/detail/elementwise_simd.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

using detail::bits;
using detail::parallel_ranges;

constexpr int64_t kSerialElements = 1 << 14;

// ---- column-owned sums over rows ----
// The embedding and bias gradients sum rows of dout into a few destination rows. Splitting the
// columns (not the rows) between threads makes each thread the only writer of its columns, so no
// partial buffers or atomics are needed, and every element is summed in row order exactly as the
// reference does: the result is bitwise the reference's whatever the thread count.

LOOM_TARGET_CLONES
void embedding_backward_cols(float* __restrict dwte, float* __restrict dwpe, const float* __restrict dout,
                             const int32_t* __restrict tokens, int64_t N, int64_t T, int64_t C, int64_t c0,
                             int64_t c1) {
  for (int64_t r = 0; r < N; ++r) {
    const float* __restrict d = dout + r * C;
    if (tokens[r] >= 0) {
      float* __restrict dw = dwte + static_cast<int64_t>(tokens[r]) * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dw[c] += d[c];
    }
    if (dwpe) {
      float* __restrict dp = dwpe + (r % T) * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dp[c] += d[c];
    }
  }
}

LOOM_TARGET_CLONES
void bias_backward_rows(float* __restrict partial, const float* __restrict dout, int64_t n0, int64_t n1, int64_t OC) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict d = dout + n * OC;
#pragma omp simd
    for (int64_t j = 0; j < OC; ++j) partial[j] += d[j];
  }
}

LOOM_TARGET_CLONES
void add_column_partials_range(float* __restrict dsum, const float* __restrict partials, int64_t blocks, int64_t C,
                               int64_t c0, int64_t c1) {
#pragma omp simd
  for (int64_t j = c0; j < c1; ++j) {
    float s = partials[j];
    for (int64_t b = 1; b < blocks; ++b) s += partials[b * C + j];
    dsum[j] += s;
  }
}

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return bf16_to_f32(v); }

// W: the weights' storage, f32 or (precision = "bf16-pure") bf16, widened exactly as rows are copied.
template <class W>
void embedding_forward_rows(float* __restrict out, const int32_t* __restrict tokens, const W* __restrict wte,
                            const W* __restrict wpe, int64_t r0, int64_t r1, int64_t T, int64_t C) {
  for (int64_t r = r0; r < r1; ++r) {
    float* __restrict o = out + r * C;
    const W* __restrict p = wpe ? wpe + (r % T) * C : nullptr;
    if (tokens[r] < 0) {  // another vocabulary shard's token: a zero row (plus the position)
      if (p)
        for (int64_t c = 0; c < C; ++c) o[c] = widen(p[c]);
      else
        std::memset(o, 0, static_cast<size_t>(C) * sizeof(float));
      continue;
    }
    const W* __restrict w = wte + static_cast<int64_t>(tokens[r]) * C;
    if (p) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = widen(w[c]) + widen(p[c]);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = widen(w[c]);
    }
  }
}

// ---- reductions ----

LOOM_TARGET_CLONES
double sum_squares_range(const float* __restrict x, int64_t i0, int64_t i1) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = i0; i < i1; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

// First index in [i0, i1) whose exponent bits are all ones (Inf or NaN), or -1. Blocks are tested
// with a vectorised OR first; only a block that contains one is scanned element by element.
LOOM_TARGET_CLONES
int64_t find_non_finite_range(const float* __restrict x, int64_t i0, int64_t i1) {
  constexpr int64_t kBlock = 1024;
  for (int64_t b = i0; b < i1; b += kBlock) {
    const int64_t e = b + kBlock < i1 ? b + kBlock : i1;
    uint32_t any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t i = b; i < e; ++i) any |= ((std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u) ? 1u : 0u;
    if (!any) continue;
    for (int64_t i = b; i < e; ++i)
      if ((std::bit_cast<uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u) return i;
  }
  return -1;
}

// ---- casts ----

LOOM_TARGET_CLONES
void cast_f32_to_bf16_range(bf16* __restrict out, const float* __restrict inp, int64_t i0, int64_t i1) {
  if (detail::elementwise_avx512()) return detail::cast_to_bf16_avx512(bits(out + i0), nullptr, inp + i0, i1 - i0);
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) out[i].bits = detail::f32_to_bf16_bits(inp[i]);
}

// Casts rows [n0, n1) and adds them into their block's partial column sums (bias_backward_rows' sums). On
// AVX-512 one pass per row; portable, two loops per row: one loop doing both mixes 16- and 32-bit
// lanes, which GCC vectorises at half width without AVX512-BW.
LOOM_TARGET_CLONES
void cast_bias_grad_rows(bf16* __restrict out, float* __restrict partial, const float* __restrict dy, int64_t n0,
                         int64_t n1, int64_t OC) {
  if (detail::elementwise_avx512()) {
    for (int64_t n = n0; n < n1; ++n) detail::cast_to_bf16_avx512(bits(out + n * OC), partial, dy + n * OC, OC);
    return;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const float* __restrict d = dy + n * OC;
    bf16* __restrict o = out + n * OC;
#pragma omp simd
    for (int64_t j = 0; j < OC; ++j) o[j].bits = detail::f32_to_bf16_bits(d[j]);
#pragma omp simd
    for (int64_t j = 0; j < OC; ++j) partial[j] += d[j];
  }
}

LOOM_TARGET_CLONES
void cast_bf16_to_f32_range(float* __restrict out, const bf16* __restrict inp, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) out[i] = std::bit_cast<float>(static_cast<uint32_t>(inp[i].bits) << 16);
}

LOOM_TARGET_CLONES
void round_to_bf16_range(float* __restrict x, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i)
    x[i] = std::bit_cast<float>(static_cast<uint32_t>(detail::f32_to_bf16_bits(x[i])) << 16);
}

// No __restrict: the residual stream is updated in place (out == a). Each out[i] depends only on
// a[i] and b[i], so the omp simd promise (no dependence across iterations) still holds.
LOOM_TARGET_CLONES
void add_range(float* out, const float* a, const float* b, int64_t i0, int64_t i1) {
#pragma omp simd
  for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C) {
  parallel_ranges(B * T, kSerialElements / (C > 0 ? C : 1) + 1, 1, [&](int64_t r0, int64_t r1, int, int) {
    embedding_forward_rows(out, tokens, wte, wpe, r0, r1, T, C);
  });
}

void embedding_forward(float* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int64_t B, int64_t T,
                       int64_t C) {
  parallel_ranges(B * T, kSerialElements / (C > 0 ? C : 1) + 1, 1, [&](int64_t r0, int64_t r1, int, int) {
    embedding_forward_rows(out, tokens, wte, wpe, r0, r1, T, C);
  });
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C) {
  detail::parallel_columns(B * T, C, kSerialElements, [&](int64_t c0, int64_t c1) {
    embedding_backward_cols(dwte, dwpe, dout, tokens, B * T, T, C, c0, c1);
  });
}

KernelCost embedding_cost(int64_t N, int64_t C) {
  // Forward with positions (GPT-2), the larger of the two layouts: read the token ids, N rows of wte
  // and of wpe, write N rows; one add per element. The backward moves about the same: read N rows of
  // dout, read and write N rows of dwte (and of dwpe).
  const double nc = static_cast<double>(N) * static_cast<double>(C);
  return {nc, 4.0 * (3.0 * nc + static_cast<double>(N))};
}

void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) {
  detail::blocked_column_sums(dbias, N, OC, kSerialElements,
                              [&](int64_t n0, int64_t n1, float* partial) { bias_backward_rows(partial, dout, n0, n1, OC); });
}

namespace detail {
void add_column_partials(float* dsum, const float* partials, int64_t blocks, int64_t C, int64_t c0, int64_t c1) {
  add_column_partials_range(dsum, partials, blocks, C, c0, c1);
}
}  // namespace detail

KernelCost bias_backward_cost(int64_t N, int64_t OC) {
  // One add per element of dout; read dout, read and write dbias once.
  const double e = static_cast<double>(N) * static_cast<double>(OC);
  return {e, 4.0 * (e + 2.0 * static_cast<double>(OC))};
}

// Per-thread partial sums over static chunks, added in thread order: deterministic for a thread count.
double sum_squares(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  std::vector<double> partial(static_cast<size_t>(omp_get_max_threads()), 0.0);
  int used = 1;
#pragma omp parallel if (n >= 4 * kSerialElements)
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    const detail::Range r = detail::thread_range(n, tid, nth, 16);
    if (r.begin < r.end) partial[static_cast<size_t>(tid)] = sum_squares_range(x, r.begin, r.end);
    if (tid == 0) used = nth;
  }
  double total = 0.0;
  for (int t = 0; t < used; ++t) total += partial[static_cast<size_t>(t)];
  return total;
}

int64_t find_non_finite(const float* x, int64_t n) {
  if (n <= 0) return -1;
  std::vector<int64_t> found(static_cast<size_t>(omp_get_max_threads()), -1);
  int used = 1;
#pragma omp parallel if (n >= 4 * kSerialElements)
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    const detail::Range r = detail::thread_range(n, tid, nth, 16);
    if (r.begin < r.end) found[static_cast<size_t>(tid)] = find_non_finite_range(x, r.begin, r.end);
    if (tid == 0) used = nth;
  }
  // Chunks are in index order, so the first thread that found one holds the lowest index.
  for (int t = 0; t < used; ++t)
    if (found[static_cast<size_t>(t)] >= 0) return found[static_cast<size_t>(t)];
  return -1;
}

void cast_f32_to_bf16(bf16* out, const float* inp, int64_t n) {
  parallel_ranges(n, kSerialElements, 32,
                  [&](int64_t i0, int64_t i1, int, int) { cast_f32_to_bf16_range(out, inp, i0, i1); });
}

void cast_f32_to_bf16_stochastic(bf16* out, const float* inp, int64_t n, const StochasticRounding& sr) {
  parallel_ranges(n, kSerialElements, 32, [&](int64_t i0, int64_t i1, int, int) {
    std::array<uint32_t, 4> block{};
    for (int64_t i = i0; i < i1; ++i) {
      const auto g = static_cast<uint64_t>(sr.first + i);
      if (i == i0 || g % 8 == 0) block = Philox::block(sr.key, sr.stream, g / 8);
      const uint32_t lane = static_cast<uint32_t>(g % 8);
      out[i] = f32_to_bf16_stochastic(inp[i], block[lane / 2] >> (16 * (lane % 2)));
    }
  });
}

void cast_f32_to_bf16_bias_grad(bf16* out, float* dbias, const float* dy, int64_t N, int64_t OC) {
  detail::blocked_column_sums(dbias, N, OC, kSerialElements, [&](int64_t n0, int64_t n1, float* partial) {
    cast_bias_grad_rows(out, partial, dy, n0, n1, OC);
  });
}

KernelCost cast_bias_grad_cost(int64_t N, int64_t OC) {
  // One add per element; read dy (4), write its bf16 copy (2); read and write dbias once.
  const double e = static_cast<double>(N) * static_cast<double>(OC);
  return {e, 6.0 * e + 8.0 * static_cast<double>(OC)};
}

void cast_bf16_to_f32(float* out, const bf16* inp, int64_t n) {
  parallel_ranges(n, kSerialElements, 32,
                  [&](int64_t i0, int64_t i1, int, int) { cast_bf16_to_f32_range(out, inp, i0, i1); });
}

void round_to_bf16_inplace(float* x, int64_t n) {
  parallel_ranges(n, kSerialElements, 16, [&](int64_t i0, int64_t i1, int, int) { round_to_bf16_range(x, i0, i1); });
}

void add(float* out, const float* a, const float* b, int64_t n) {
  parallel_ranges(n, kSerialElements, 16, [&](int64_t i0, int64_t i1, int, int) { add_range(out, a, b, i0, i1); });
}

void fill_zero(float* x, int64_t n) {
  // Zeroing a step's gradients (56 MB for `mini`) on one thread ran at about half the memory bandwidth.
  parallel_ranges(n, 4 * kSerialElements, 16, [&](int64_t i0, int64_t i1, int, int) {
    std::memset(x + i0, 0, static_cast<size_t>(i1 - i0) * sizeof(float));
  });
}

KernelCost fill_zero_cost(int64_t n) { return {0.0, 4.0 * static_cast<double>(n)}; }

KernelCost sum_squares_cost(int64_t n) {
  // A multiply-add per element (in double); the values read once.
  return {2.0 * static_cast<double>(n), 4.0 * static_cast<double>(n)};
}

KernelCost cast_cost(int64_t n) {
  // f32 -> bf16 rounding: read 4 bytes, write 2 per element, ~5 integer ops that are not FLOPs.
  // (add moves 12 bytes and does 1 flop per element; bf16 -> f32 moves 6.)
  return {0.0, 6.0 * static_cast<double>(n)};
}

}  // namespace loom::kernels
