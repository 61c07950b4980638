// FP8 fake quantisation (kernels/fp8_quant.h, issue 16 item 2) against the reference conversion of
// core/fp8.h (itself tested against the OCP specification's definition): every element is
// decode(encode(x * scale)) / scale exactly, per tensor, per 1 x 128 block of a row and per 128 x 128
// tile, with the scale each recipe takes from the amax, and the overflow and underflow counts match.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "loom/core/fp8.h"
#include "loom/kernels/fp8_quant.h"

namespace loom::kernels {
namespace {

float reference(float x, Fp8Format f, float scale) { return fp8_decode(fp8_encode(x * scale, f), f) / scale; }

// Values over the whole range a format covers after scaling: subnormals, normals, beyond the largest
// value, exact zeros and ties.
std::vector<float> spread(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> exponent(-24.0f, 18.0f), sign(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = std::copysign(std::exp2(exponent(rng)), sign(rng));
  x[0] = 0.0f, x[1] = -0.0f, x[2] = 448.0f, x[3] = 464.0f /* tie above 448 */, x[4] = 1.0f + 1.0f / 16 /* tie */;
  return x;
}

TEST(Fp8Quant, RoundingIsTheReferenceConversionOnEveryFormat) {
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const auto x = spread(200000, 7);
    int64_t wrong = 0;
    for (float v : x) wrong += fp8_round(v, f) != fp8_decode(fp8_encode(v, f), f);
    EXPECT_EQ(wrong, 0) << (f == Fp8Format::E4M3 ? "E4M3" : "E5M2");
  }
}

TEST(Fp8Quant, ScaleIsThePowerOfTwoThatFitsTheAmax) {
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    for (float a : {1e-30f, 3e-5f, 0.1f, 1.0f, 448.0f, 449.0f, 3e4f, 1e20f}) {
      const float s = fp8_scale(a, f);
      int e = 0;
      EXPECT_EQ(std::frexp(s, &e), 0.5f) << "a power of two";
      EXPECT_LE(a * s, fp8_max(f)) << a;
      EXPECT_GT(2.0 * a * s, fp8_max(f)) << a << ": the largest such power";
      EXPECT_EQ(fp8_scale(a, f, 2), s / 4) << "margin";
    }
    EXPECT_EQ(fp8_scale(0.0f, f), 1.0f);
    EXPECT_EQ(fp8_scale(NAN, f), 1.0f);
  }
}

TEST(Fp8Quant, PerTensorIsTheReferenceWithCountsAndIsIdempotent) {
  const int64_t n = 100003;
  const auto x = spread(n, 11);
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    for (float scale : {1.0f, 1.0f / 256, 64.0f}) {
      std::vector<bf16> out(static_cast<size_t>(n));
      std::vector<float> out32(static_cast<size_t>(n));
      const Fp8Stats s = fake_quantize(out.data(), x.data(), n, f, scale);
      const Fp8Stats s32 = fake_quantize(out32.data(), x.data(), n, f, scale);
      int64_t wrong = 0, overflow = 0, underflow = 0;
      float amax_ref = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float want = reference(x[i], f, scale);
        wrong += bf16_to_f32(out[i]) != want || out32[i] != want;
        overflow += !std::isfinite(fp8_decode(fp8_encode(x[i] * scale, f, false), f));  // rounded beyond the max
        underflow += want == 0.0f && x[i] != 0.0f;
        amax_ref = std::max(amax_ref, std::fabs(x[i]));
      }
      EXPECT_EQ(wrong, 0) << scale;
      EXPECT_EQ(s.amax, amax_ref);
      EXPECT_EQ(s.overflow, overflow);
      EXPECT_GT(s.overflow + s.underflow, 0) << "the spread reaches both ends";
      EXPECT_EQ(s.underflow, underflow);
      EXPECT_EQ(s32.overflow, s.overflow);
      // Quantised values quantise to themselves under the same scale.
      std::vector<bf16> again(static_cast<size_t>(n));
      fake_quantize(again.data(), out.data(), n, f, scale);
      EXPECT_EQ(std::memcmp(again.data(), out.data(), out.size() * sizeof(bf16)), 0);
    }
  }
}

TEST(Fp8Quant, BlockwiseScalesEachRowBlockAndEachTileByItsOwnAmax) {
  const int64_t rows = 131, cols = 300, block = 128;  // edge blocks and tiles are partial
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  // Rows of very different magnitudes: one scale for all would underflow the small ones.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(r * cols + c)] = normal(rng) * std::exp2(static_cast<float>((r % 9) * 4 - 16 + c / 128));
  std::vector<bf16> out(x.size()), w(x.size()), wout(x.size());
  const Fp8Stats s = fake_quantize_rows(out.data(), x.data(), rows, cols, block, Fp8Format::E4M3);
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += block) {
      float a = 0;
      for (int64_t c = c0; c < std::min(c0 + block, cols); ++c) a = std::max(a, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      const float scale = fp8_scale(a, Fp8Format::E4M3);
      for (int64_t c = c0; c < std::min(c0 + block, cols); ++c)
        wrong += bf16_to_f32(out[static_cast<size_t>(r * cols + c)]) != reference(x[static_cast<size_t>(r * cols + c)], Fp8Format::E4M3, scale);
    }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(s.overflow, 0) << "a block's own scale never saturates";

  for (size_t i = 0; i < x.size(); ++i) w[i] = f32_to_bf16(x[i]);
  fake_quantize_tiles(wout.data(), w.data(), rows, cols, block, Fp8Format::E4M3);
  wrong = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += block)
    for (int64_t c0 = 0; c0 < cols; c0 += block) {
      float a = 0;
      for (int64_t r = r0; r < std::min(r0 + block, rows); ++r)
        for (int64_t c = c0; c < std::min(c0 + block, cols); ++c) a = std::max(a, std::fabs(bf16_to_f32(w[static_cast<size_t>(r * cols + c)])));
      const float scale = fp8_scale(a, Fp8Format::E4M3);
      for (int64_t r = r0; r < std::min(r0 + block, rows); ++r)
        for (int64_t c = c0; c < std::min(c0 + block, cols); ++c)
          wrong += bf16_to_f32(wout[static_cast<size_t>(r * cols + c)]) !=
                   reference(bf16_to_f32(w[static_cast<size_t>(r * cols + c)]), Fp8Format::E4M3, scale);
    }
  EXPECT_EQ(wrong, 0);
}

}  // namespace
}  // namespace loom::kernels
