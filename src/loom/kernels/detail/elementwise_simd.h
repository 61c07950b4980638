// Implementation helpers shared by the fast element-wise kernels (norms, activations, rope, loss,
// optimizer, casts): how work is split over OpenMP threads, and scalar math written so that GCC
// vectorises it inside `#pragma omp simd` loops. Not part of the kernels' public interface.
#pragma once

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

// Hot loops are compiled three times and the best version is picked at load time, because the build
// has no -march flag (Loom must run on any x86-64). Only leaf functions carry the attribute: the
// OpenMP regions stay in plain functions and call into the clones, so the dispatch happens once per
// thread, not per element. A build may predefine the macro (e.g. empty, or target("avx2")) to test
// one code path on a machine whose dispatcher would pick another.
#ifndef LOOM_TARGET_CLONES
#define LOOM_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace loom::kernels::detail {

// Work split: thread `tid` of `nth` gets the contiguous range [begin, end) of [0, n), with boundaries
// rounded to multiples of `align` elements (a cache line = 16 floats) so that threads never write
// the same line. The split depends only on (n, nth), which is what makes every kernel bitwise
// deterministic for a given thread count.
struct Range {
  int64_t begin;
  int64_t end;
};

inline Range thread_range(int64_t n, int tid, int nth, int64_t align = 1) {
  int64_t units = (n + align - 1) / align;
  int64_t b = units * tid / nth * align;
  int64_t e = units * (tid + 1) / nth * align;
  return {std::min(b, n), std::min(e, n)};
}

// Runs body(begin, end, tid, nth) on each thread's static slice of [0, n). Below `serial_below` items
// the fork/join (a few microseconds) would cost more than the work, so one thread does it all.
template <class Body>
void parallel_ranges(int64_t n, int64_t serial_below, int64_t align, Body&& body) {
  if (n <= 0) return;
#pragma omp parallel if (n >= serial_below)
  {
    const int tid = omp_get_thread_num();
    const int nth = omp_get_num_threads();
    Range r = thread_range(n, tid, nth, align);
    if (r.begin < r.end) body(r.begin, r.end, tid, nth);
  }
}

// Runs body(c0, c1) on each thread's block of the C columns (cache-line aligned) of an [N, C] array, for
// kernels that scatter or sum down columns (the embedding gradient): each column is handled in row order
// by one thread. One thread below `serial_below` elements. (Bias gradients use blocked_column_sums.)
template <class Body>
void parallel_columns(int64_t N, int64_t C, int64_t serial_below, Body&& body) {
  if (N <= 0 || C <= 0) return;
#pragma omp parallel if (N * C >= serial_below)
  {
    const Range cols = thread_range(C, omp_get_thread_num(), omp_get_num_threads(), 16);
    if (cols.begin < cols.end) body(cols.begin, cols.end);
  }
}

// Column sums of an [N, C] array (bias gradients) over fixed blocks of kSumRows rows: `rows(n0, n1,
// partial)` adds rows [n0, n1) into its block's zeroed partial sums in row order (and may do other
// work on those rows: a cast, an activation's backward); then every column's partials are added in
// block order and into dsum. Blocks, not threads, fix the order of the additions: the sums are
// bitwise the same for any thread count, and every kernel that sums columns this way agrees with the
// others bit for bit. Each thread streams whole rows (splitting the columns between threads instead
// left the second core nearly idle on the EPYC: its prefetches fetched the other's half of each row).
inline constexpr int64_t kSumRows = 128;
// dsum[j] += sum over b < blocks of partials[b * C + j], for columns [c0, c1).
void add_column_partials(float* dsum, const float* partials, int64_t blocks, int64_t C, int64_t c0, int64_t c1);

template <class Rows>
void blocked_column_sums(float* dsum, int64_t N, int64_t C, int64_t serial_below, Rows&& rows) {
  if (N <= 0 || C <= 0) return;
  const int64_t blocks = (N + kSumRows - 1) / kSumRows;
  // Kept per calling thread: at most a few hundred KiB, and a fresh one per call would fault its
  // pages in every time.
  thread_local std::vector<float> partials;
  partials.assign(static_cast<size_t>(blocks * C), 0.0f);
  float* p = partials.data();
#pragma omp parallel if (N * C >= serial_below)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const Range mine = thread_range(blocks, tid, nth);
    for (int64_t b = mine.begin; b < mine.end; ++b) rows(b * kSumRows, std::min(N, (b + 1) * kSumRows), p + b * C);
#pragma omp barrier
    const Range cols = thread_range(C, tid, nth, 16);
    if (cols.begin < cols.end) add_column_partials(dsum, p, blocks, C, cols.begin, cols.end);
  }
}

// c ? a : b as a bit mask instead of a branch. Written as ?: on floats, GCC (without -ffast-math)
// keeps the branch, threads constant clamped values through it, and then cannot vectorise the loop
// for AVX2/SSE (only AVX-512 masking copes). A mask has no branch to thread. NaN in b passes through.
inline float select(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & mask) | (std::bit_cast<uint32_t>(b) & ~mask));
}

// exp(x) for float in about 2 ulp (Cephes expf: range reduction x = n ln2 + r, |r| <= ln2/2, then a
// degree-6 polynomial for e^r and 2^n put straight into the exponent bits). Unlike std::exp it
// vectorises in an omp simd loop without -ffast-math. Inputs are clamped to [-86.5, 88.3] so that
// 2^n stays a normal float: exp underflows to ~3e-38 instead of 0, which no caller can tell apart
// from 0 next to terms of order 1. NaN propagates (both comparisons are false for NaN). The rounding of
// x*log2(e) uses the 1.5*2^23 trick instead of a float->int conversion, which is undefined for NaN.
inline float fast_exp(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  x = select(x < -86.5f, -86.5f, x);
  x = select(x > 88.3f, 88.3f, x);
  const float t = x * 1.44269504088896341f + kMagic;
  const float n = t - kMagic;
  float r = x - n * 0.693359375f;  // ln2 split in two (Cody-Waite) so that n*ln2 is exact enough
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // The low mantissa bits of t hold n (two's complement); shifting them into the exponent field and
  // adding multiplies p by 2^n.
  const uint32_t scale = std::bit_cast<uint32_t>(t) << 23;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(p) + scale);
}

// 1 / (1 + exp(-x)), written so that neither tail cancels: large positive x gives 1/(1+tiny), large
// negative x gives 1/(1+huge) ~ exp(x), both with full relative accuracy.
inline float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

// Round-to-nearest-even f32 -> bf16 bits, the branch-free form of loom::f32_to_bf16 (same results bit
// for bit, NaN kept quiet) so that it vectorises.
inline uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace loom::kernels::detail
