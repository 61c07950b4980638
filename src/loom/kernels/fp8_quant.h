// FP8 quantisation of GEMM inputs, emulated (precision = "fp8"): values are scaled by a power of two,
// rounded to the E4M3 or E5M2 grid (nearest even, saturating at the largest finite value, with
// subnormals) and scaled back, and the result is written as bf16. Because the scale is a power of two
// and fp8 keeps at most 3 mantissa bits, every written value is exactly the fp8 number / scale: a bf16
// GEMM with f32 accumulation over them computes what an fp8 GEMM with f32 accumulation computes (up to
// the order of the sums). This is an honest model of fp8's numerics on a CPU without fp8 units, not a
// speed-up: it costs one more pass over each input.
//
// Scales: scale = 2^floor(log2(fp8_max / amax)) (minus `margin` powers of two), 1 when amax is 0, so
// amax * scale never exceeds the format's largest value. Per tensor (delayed or current scaling), per
// 1 x B block of a row (blockwise activations and gradients) or per B x B tile (blockwise weights).
#pragma once

#include <cstdint>

#include "loom/core/bf16.h"
#include "loom/core/fp8.h"

namespace loom::kernels {

// What one quantisation saw: the largest |x| before scaling, how many elements saturated (|x| * scale
// rounded beyond the largest finite value) and how many non-zero elements became zero.
struct Fp8Stats {
  float amax = 0;
  int64_t overflow = 0, underflow = 0;
  void merge(const Fp8Stats& o) {
    amax = amax > o.amax ? amax : o.amax;
    overflow += o.overflow, underflow += o.underflow;
  }
};

// The power-of-two scale for a tensor (or block) whose largest |x| is amax.
float fp8_scale(float amax, Fp8Format f, int margin = 0);
// x rounded to the fp8 grid of format f (x already scaled): nearest even, saturating.
float fp8_round(float x, Fp8Format f);

// Largest |x| over n elements (f32 or bf16).
float amax(const float* x, int64_t n);
float amax(const bf16* x, int64_t n);

// Per-tensor: out[i] = bf16(fp8_round(x[i] * scale) / scale), over n elements of f32 or bf16 input.
// `out` may alias `x` only for the bf16 input.
Fp8Stats fake_quantize(bf16* out, const float* x, int64_t n, Fp8Format f, float scale);
Fp8Stats fake_quantize(bf16* out, const bf16* x, int64_t n, Fp8Format f, float scale);
// The same into f32 output (an output gradient, which the linear's backward then casts to bf16 exactly).
Fp8Stats fake_quantize(float* out, const float* x, int64_t n, Fp8Format f, float scale);

// Blockwise, current scaling per block: x is [rows, cols] row-major; every 1 x block run of a row
// (the last one of a row may be shorter) gets the scale of its own amax.
Fp8Stats fake_quantize_rows(bf16* out, const float* x, int64_t rows, int64_t cols, int64_t block, Fp8Format f);
Fp8Stats fake_quantize_rows(float* out, const float* x, int64_t rows, int64_t cols, int64_t block, Fp8Format f);
// Every block x block tile of w [rows, cols] (edge tiles smaller) gets the scale of its own amax.
Fp8Stats fake_quantize_tiles(bf16* out, const bf16* w, int64_t rows, int64_t cols, int64_t block, Fp8Format f);

}  // namespace loom::kernels
