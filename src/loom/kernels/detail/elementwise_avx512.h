// Element loops on AVX-512 intrinsics (elementwise_avx512.cpp), where the element-wise kernels take
// ElementwisePath::Avx512 (elementwise.h): the activations -- the same math as the portable loops of
// activations.cpp, with exp taken as 2^z by VSCALEFPS instead of the exponent-bit trick and its range
// clamps, about twice as fast where they are compute-bound (GELU on the AVX-512 EPYC: 0.40 -> 0.18 ns
// an element in L1) -- and the bf16 casts, rounding in registers in one pass with whatever else reads
// the values (a bias gradient's column sums). Only called where the CPU has AVX-512F.
#pragma once

#include <cstdint>

#include "loom/core/bf16.h"

namespace loom::kernels::detail {

// bf16's storage, as these loops take it (16-bit words).
inline uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }

// Whether the element-wise kernels run these loops now (elementwise_path.cpp: the CPU, the ISA cap, or
// a test's force_elementwise_path).
bool elementwise_avx512();

// Each in two forms: f32 results, or results rounded to bf16 (nearest even, bit for bit
// detail::f32_to_bf16_bits) in the same pass -- the fused casts of precision bf16.
// out[i] = gelu(x[i]) (tanh form)
void gelu_forward_avx512(float* out, const float* x, int64_t n);
void gelu_forward_avx512(uint16_t* out, const float* x, int64_t n);
// dx[i] = gelu'(x[i]) dy[i]; the bf16 form also adds the f32 dx[i] into sums[i] when sums is not null
// (one row of the bias gradient's column sums).
void gelu_backward_avx512(float* dx, const float* x, const float* dy, int64_t n);
void gelu_backward_avx512(uint16_t* dx, float* sums, const float* x, const float* dy, int64_t n);
// y[i] = silu(g[i]) u[i]
void swiglu_forward_avx512(float* y, const float* g, const float* u, int64_t n);
void swiglu_forward_avx512(uint16_t* y, const float* g, const float* u, int64_t n);
// dg[i], du[i]: the gradients of silu(g) u times dy[i]
void swiglu_backward_avx512(float* dg, float* du, const float* g, const float* u, const float* dy, int64_t n);
void swiglu_backward_avx512(uint16_t* dg, uint16_t* du, const float* g, const float* u, const float* dy, int64_t n);
// out[i] = bf16(x[i]); when sums is not null, sums[i] += x[i] first (a row of a bias gradient's sums).
void cast_to_bf16_avx512(uint16_t* out, float* sums, const float* x, int64_t n);

}  // namespace loom::kernels::detail
