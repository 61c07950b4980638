// GELU, SwiGLU and bf16 cast loops with AVX-512 intrinsics (see detail/elementwise_avx512.h).
//
// Every exp is written as 2^z with log2(e) folded into the argument's constants: z splits into
// n = round(z) and f = z - n in [-1/2, 1/2], 2^f is a degree-6 Taylor polynomial (relative error
// < 1.3e-7), and VSCALEFPS multiplies by 2^n. z is clamped to [-127, 127] so that 2^z stays finite
// and non-zero: the gradients below multiply e = 2^z by 1 / (1 + e), and inf * 0 would be NaN (an
// input NaN still gives NaN, through the x it is multiplied by). Divisions stay divisions: on the
// AVX-512 EPYC VDIVPS beat VRCP14PS plus a Newton step (0.175 vs 0.197 ns a GELU element).
#include "loom/kernels/detail/elementwise_avx512.h"

#include <immintrin.h>

#include "loom/kernels/detail/exp2_avx512.h"

// GCC 12 warns that the undefined vector behind a zeroing intrinsic may be used uninitialized (a
// known false positive of its headers).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace loom::kernels::detail {
namespace {

#define LOOM_AVX512 __attribute__((target("avx512f")))

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// Whole vectors load and store plainly; only a row's last partial vector is masked (masked loads and
// stores of every vector made GELU's backward 50% slower on the EPYC).
template <bool Tail>
LOOM_AVX512 inline __m512 load(__mmask16 m, const float* p) {
  return Tail ? _mm512_maskz_loadu_ps(m, p) : _mm512_loadu_ps(p);
}
template <bool Tail>
LOOM_AVX512 inline void store(__mmask16 m, float* p, __m512 v) {
  if (Tail)
    _mm512_mask_storeu_ps(p, m, v);
  else
    _mm512_storeu_ps(p, v);
}

// Runs step.run<false>(i, all lanes) on each whole vector of [0, n), then step.run<true>(i, mask) on
// the last partial one.
template <class Step>
LOOM_AVX512 inline void for_vectors(int64_t n, const Step& step) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) step.template run<false>(i, static_cast<__mmask16>(0xFFFF));
  if (i < n) step.template run<true>(i, static_cast<__mmask16>((1u << (n - i)) - 1));
}

// 2^z for z clamped to [-127, 127] (finite and non-zero, see the top).
LOOM_AVX512 inline __m512 exp2_ps(__m512 z) {
  return exp2_avx512(_mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)));
}

// GELU's e = exp(-2u) = 2^(x (a + b x^2)), u = sqrt(2/pi) (x + 0.044715 x^3).
LOOM_AVX512 inline __m512 gelu_exp(__m512 x) {
  const __m512 a = _mm512_set1_ps(-2.0f * kGeluScale * kLog2e);
  const __m512 b = _mm512_set1_ps(-2.0f * kGeluScale * kGeluCubic * kLog2e);
  return exp2_ps(_mm512_mul_ps(x, _mm512_fmadd_ps(b, _mm512_mul_ps(x, x), a)));
}

// Where a kernel's f32 results go, vector by vector: f32 as they are, or rounded to bf16 (nearest even,
// NaN kept quiet: bit for bit detail::f32_to_bf16_bits) -- optionally first added into column sums (the
// bias gradient's partial sums of the row block, as detail::blocked_column_sums adds them).
struct F32Out {
  float* p;
  template <bool Tail>
  LOOM_AVX512 void put(__mmask16 m, int64_t i, __m512 v) const {
    store<Tail>(m, p + i, v);
  }
};

struct Bf16Out {
  uint16_t* p;
  float* sums = nullptr;  // column sums to add the f32 values into first, or none
  template <bool Tail>
  LOOM_AVX512 void put(__mmask16 m, int64_t i, __m512 v) const {
    if (sums) store<Tail>(m, sums + i, _mm512_add_ps(load<Tail>(m, sums + i), v));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    if (Tail)
      _mm512_mask_cvtepi32_storeu_epi16(p + i, m, r);  // VPMOVDW to memory: AVX-512F, no BW needed
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm512_cvtepi32_epi16(r));
  }
};

// One vector of each kernel: the inputs at i, the results handed to Out at i.
template <class Out>
struct GeluForward {
  Out out;
  const float* x;
  template <bool Tail>
  LOOM_AVX512 void run(int64_t i, __mmask16 m) const {
    const __m512 v = load<Tail>(m, x + i);
    // x sigmoid(2u) = x / (1 + exp(-2u))
    out.template put<Tail>(m, i, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), gelu_exp(v))));
  }
};

template <class Out>
struct GeluBackward {
  Out dx;
  const float *x, *dy;
  template <bool Tail>
  LOOM_AVX512 void run(int64_t i, __mmask16 m) const {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 v = load<Tail>(m, x + i), d = load<Tail>(m, dy + i);
    const __m512 e = gelu_exp(v);
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, e));  // 0.5 (1 + tanh u)
    const __m512 k3c = _mm512_set1_ps(3.0f * kGeluScale * kGeluCubic);
    const __m512 du_dx = _mm512_fmadd_ps(k3c, _mm512_mul_ps(v, v), _mm512_set1_ps(kGeluScale));
    // (s + 2 x s (1 - s) du/dx) dy, with 1 - s = e s
    const __m512 t = _mm512_mul_ps(_mm512_add_ps(v, v), _mm512_mul_ps(s, _mm512_mul_ps(e, s)));
    dx.template put<Tail>(m, i, _mm512_mul_ps(_mm512_fmadd_ps(t, du_dx, s), d));
  }
};

template <class Out>
struct SwigluForward {
  Out y;
  const float *g, *u;
  template <bool Tail>
  LOOM_AVX512 void run(int64_t i, __mmask16 m) const {
    const __m512 gv = load<Tail>(m, g + i), uv = load<Tail>(m, u + i);
    // silu(g) u = g u / (1 + exp(-g))
    const __m512 e = exp2_ps(_mm512_mul_ps(gv, _mm512_set1_ps(-kLog2e)));
    y.template put<Tail>(m, i, _mm512_div_ps(_mm512_mul_ps(gv, uv), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  }
};

struct Cast {
  Bf16Out out;
  const float* x;
  template <bool Tail>
  LOOM_AVX512 void run(int64_t i, __mmask16 m) const {
    out.template put<Tail>(m, i, load<Tail>(m, x + i));
  }
};

template <class Out>
struct SwigluBackward {
  Out dg, du;
  const float *g, *u, *dy;
  template <bool Tail>
  LOOM_AVX512 void run(int64_t i, __mmask16 m) const {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 gv = load<Tail>(m, g + i), uv = load<Tail>(m, u + i), d = load<Tail>(m, dy + i);
    const __m512 e = exp2_ps(_mm512_mul_ps(gv, _mm512_set1_ps(-kLog2e)));
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
    // d silu / dg = sig (1 + g (1 - sig)), with 1 - sig = e sig
    const __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(gv, _mm512_mul_ps(e, sig), one));
    dg.template put<Tail>(m, i, _mm512_mul_ps(_mm512_mul_ps(d, uv), dsilu));
    du.template put<Tail>(m, i, _mm512_mul_ps(_mm512_mul_ps(d, gv), sig));
  }
};

}  // namespace

LOOM_AVX512 void gelu_forward_avx512(float* out, const float* x, int64_t n) {
  for_vectors(n, GeluForward<F32Out>{{out}, x});
}
LOOM_AVX512 void gelu_forward_avx512(uint16_t* out, const float* x, int64_t n) {
  for_vectors(n, GeluForward<Bf16Out>{{out}, x});
}

LOOM_AVX512 void gelu_backward_avx512(float* dx, const float* x, const float* dy, int64_t n) {
  for_vectors(n, GeluBackward<F32Out>{{dx}, x, dy});
}
LOOM_AVX512 void gelu_backward_avx512(uint16_t* dx, float* sums, const float* x, const float* dy, int64_t n) {
  for_vectors(n, GeluBackward<Bf16Out>{{dx, sums}, x, dy});
}

LOOM_AVX512 void swiglu_forward_avx512(float* y, const float* g, const float* u, int64_t n) {
  for_vectors(n, SwigluForward<F32Out>{{y}, g, u});
}
LOOM_AVX512 void swiglu_forward_avx512(uint16_t* y, const float* g, const float* u, int64_t n) {
  for_vectors(n, SwigluForward<Bf16Out>{{y}, g, u});
}

LOOM_AVX512 void swiglu_backward_avx512(float* dg, float* du, const float* g, const float* u, const float* dy,
                                        int64_t n) {
  for_vectors(n, SwigluBackward<F32Out>{{dg}, {du}, g, u, dy});
}
LOOM_AVX512 void swiglu_backward_avx512(uint16_t* dg, uint16_t* du, const float* g, const float* u, const float* dy,
                                        int64_t n) {
  for_vectors(n, SwigluBackward<Bf16Out>{{dg}, {du}, g, u, dy});
}

LOOM_AVX512 void cast_to_bf16_avx512(uint16_t* out, float* sums, const float* x, int64_t n) {
  for_vectors(n, Cast{{out, sums}, x});
}

}  // namespace loom::kernels::detail
