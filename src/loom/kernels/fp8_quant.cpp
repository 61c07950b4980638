#include "loom/kernels/fp8_quant.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/kernels/detail/elementwise_simd.h"

namespace loom::kernels {
namespace {

constexpr int64_t kSerialElements = 1 << 14;

// The grid of a format: mantissa bits, the smallest normal exponent, the largest finite value, and the
// constant whose addition rounds a subnormal to its quantum 2^(min_exp - M) (the f32 ulp at it).
struct Grid {
  int mantissa_bits;
  float min_normal, max_finite, subnormal_magic;
};

Grid grid(Fp8Format f) {
  return f == Fp8Format::E4M3 ? Grid{3, std::ldexp(1.0f, -6), 448.0f, std::ldexp(1.0f, -6 - 3 + 23)}
                              : Grid{2, std::ldexp(1.0f, -14), 57344.0f, std::ldexp(1.0f, -14 - 2 + 23)};
}

// |x| (scaled) onto the grid: subnormals by the magic addition (the FPU's nearest even), normals by
// rounding the f32 mantissa to M bits (nearest even), beyond the largest value saturated.
inline float round_abs(float a, const Grid& g, bool& saturated) {
  float r;
  if (a < g.min_normal) {
    r = (a + g.subnormal_magic) - g.subnormal_magic;  // no -ffast-math: the FPU rounds the sum
  } else {
    uint32_t u = std::bit_cast<uint32_t>(a);
    const int shift = 23 - g.mantissa_bits;
    u += ((1u << (shift - 1)) - 1) + ((u >> shift) & 1u);
    u &= ~((1u << shift) - 1);
    r = std::bit_cast<float>(u);
  }
  saturated = r > g.max_finite;
  return saturated ? g.max_finite : r;
}

inline float widen_value(float v) { return v; }
inline float widen_value(bf16 v) { return bf16_to_f32(v); }
inline void store(bf16& out, float v) { out = f32_to_bf16(v); }  // exact: v has <= 3 mantissa bits
inline void store(float& out, float v) { out = v; }

template <class In, class Out>
void quantize_range(Out* out, const In* x, int64_t i0, int64_t i1, const Grid& g, float scale, Fp8Stats& s) {
  const float inverse = 1.0f / scale;  // exact: a power of two
  for (int64_t i = i0; i < i1; ++i) {
    const float v = widen_value(x[i]);
    const float a = std::fabs(v);
    if (a > s.amax) s.amax = a;
    bool saturated = false;
    const float r = round_abs(a * scale, g, saturated);
    s.overflow += saturated;
    s.underflow += (r == 0.0f && a != 0.0f);
    store(out[i], std::copysign(r * inverse, v));
  }
}

// Runs body(i0, i1, stats) over thread slices of [0, n) and merges the threads' stats.
// `n` items: elements (one thread below kSerialElements), or blocks (`blocks`: split from 64 on).
template <class Body>
Fp8Stats parallel_stats(int64_t n, Body&& body, bool blocks = false) {
  std::vector<Fp8Stats> per(static_cast<size_t>(omp_get_max_threads()));
  detail::parallel_ranges(n, blocks ? 64 : kSerialElements, blocks ? 1 : 16,
                          [&](int64_t i0, int64_t i1, int tid, int) { body(i0, i1, per[static_cast<size_t>(tid)]); });
  Fp8Stats all;
  for (const auto& s : per) all.merge(s);
  return all;
}

template <class In, class Out>
Fp8Stats quantize(Out* out, const In* x, int64_t n, Fp8Format f, float scale) {
  const Grid g = grid(f);
  return parallel_stats(n, [&](int64_t i0, int64_t i1, Fp8Stats& s) { quantize_range(out, x, i0, i1, g, scale, s); });
}

template <class T>
float amax_of(const T* x, int64_t n) {
  return parallel_stats(n, [&](int64_t i0, int64_t i1, Fp8Stats& s) {
           for (int64_t i = i0; i < i1; ++i) s.amax = std::max(s.amax, std::fabs(widen_value(x[i])));
         }).amax;
}

template <class Out>
Fp8Stats quantize_rows(Out* out, const float* x, int64_t rows, int64_t cols, int64_t block, Fp8Format f) {
  const Grid g = grid(f);
  const int64_t per_row = (cols + block - 1) / block;
  return parallel_stats(rows * per_row, [&](int64_t b0, int64_t b1, Fp8Stats& s) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / per_row, c0 = (b % per_row) * block, c1 = std::min(c0 + block, cols);
      const float* in = x + r * cols;
      float a = 0;
      for (int64_t c = c0; c < c1; ++c) a = std::max(a, std::fabs(in[c]));
      quantize_range(out + r * cols, in, c0, c1, g, fp8_scale(a, f), s);
    }
  }, true);
}

}  // namespace

float fp8_scale(float amax, Fp8Format f, int margin) {
  if (!(amax > 0) || !std::isfinite(amax)) return 1.0f;
  // The largest power of two s with amax * s <= max: 2^floor(log2(max / amax)), kept inside f32's
  // normal range so that 1 / s is exact too.
  int e = static_cast<int>(std::floor(std::log2(static_cast<double>(fp8_max(f)) / static_cast<double>(amax)))) - margin;
  while (e > -126 && static_cast<double>(amax) * std::ldexp(1.0, e) > fp8_max(f)) --e;  // log2's rounding
  return std::ldexp(1.0f, std::clamp(e, -126, 126));
}

float fp8_round(float x, Fp8Format f) {
  bool saturated = false;
  return std::copysign(round_abs(std::fabs(x), grid(f), saturated), x);
}

float amax(const float* x, int64_t n) { return amax_of(x, n); }
float amax(const bf16* x, int64_t n) { return amax_of(x, n); }

Fp8Stats fake_quantize(bf16* out, const float* x, int64_t n, Fp8Format f, float scale) { return quantize(out, x, n, f, scale); }
Fp8Stats fake_quantize(bf16* out, const bf16* x, int64_t n, Fp8Format f, float scale) { return quantize(out, x, n, f, scale); }
Fp8Stats fake_quantize(float* out, const float* x, int64_t n, Fp8Format f, float scale) { return quantize(out, x, n, f, scale); }

Fp8Stats fake_quantize_rows(bf16* out, const float* x, int64_t rows, int64_t cols, int64_t block, Fp8Format f) {
  return quantize_rows(out, x, rows, cols, block, f);
}
Fp8Stats fake_quantize_rows(float* out, const float* x, int64_t rows, int64_t cols, int64_t block, Fp8Format f) {
  return quantize_rows(out, x, rows, cols, block, f);
}

Fp8Stats fake_quantize_tiles(bf16* out, const bf16* w, int64_t rows, int64_t cols, int64_t block, Fp8Format f) {
  const Grid g = grid(f);
  const int64_t tile_rows = (rows + block - 1) / block, tile_cols = (cols + block - 1) / block;
  return parallel_stats(tile_rows * tile_cols, [&](int64_t t0, int64_t t1, Fp8Stats& s) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = (t / tile_cols) * block, r1 = std::min(r0 + block, rows);
      const int64_t c0 = (t % tile_cols) * block, c1 = std::min(c0 + block, cols);
      float a = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) a = std::max(a, std::fabs(bf16_to_f32(w[r * cols + c])));
      const float scale = fp8_scale(a, f);
      for (int64_t r = r0; r < r1; ++r) quantize_range(out + r * cols, w + r * cols, c0, c1, g, scale, s);
    }
  }, true);
}

}  // namespace loom::kernels
