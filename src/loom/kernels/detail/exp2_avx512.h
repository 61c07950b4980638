// 2^x on 16 floats, shared by the kernels written with AVX-512 intrinsics (bf16 attention's base-2
// softmax, the activations): 2^x = 2^n 2^f with n = round(x) and |f| <= 1/2, 2^f by its degree-6
// Taylor polynomial (relative error < 1.3e-7, about an f32 ulp), 2^n applied by VSCALEFPS, which takes
// any very negative n to exactly 0 and any very positive one to +inf. x = -inf gives NaN (f = -inf -
// -inf): callers keep x finite.
#pragma once

#include <immintrin.h>

namespace loom::kernels::detail {

__attribute__((target("avx512f"), always_inline)) inline __m512 exp2_avx512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace loom::kernels::detail
