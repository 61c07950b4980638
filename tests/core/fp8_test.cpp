// FP8 conversion (core/fp8.h) against a reference built from the OCP specification's definition: every
// one of the 256 codes decodes to sign x 2^(e - bias) x (1 + m / 2^M) (subnormals, E4M3's single NaN,
// E5M2's infinities); every finite code encodes back to itself; and for f32 inputs across the whole
// range the encoding is the nearest representable value, ties to the even code, saturating (or not)
// beyond the largest.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "loom/core/fp8.h"

namespace loom {
namespace {

// The specification's decoding, in double.
double reference(uint8_t c, Fp8Format f) {
  const int E = f == Fp8Format::E4M3 ? 4 : 5, M = f == Fp8Format::E4M3 ? 3 : 2, bias = f == Fp8Format::E4M3 ? 7 : 15;
  const int e = (c >> M) & ((1 << E) - 1), m = c & ((1 << M) - 1);
  const double s = (c & 0x80) ? -1 : 1;
  if (f == Fp8Format::E5M2 && e == 31) return m ? NAN : s * INFINITY;
  if (f == Fp8Format::E4M3 && e == 15 && m == 7) return NAN;
  if (e == 0) return s * m * std::pow(2.0, 1 - bias - M);
  return s * (1 + m / double(1 << M)) * std::pow(2.0, e - bias);
}

TEST(Fp8, EveryCodeDecodesAsTheSpecificationSaysAndEncodesBackToItself) {
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (int c = 0; c < 256; ++c) {
      const double want = reference(static_cast<uint8_t>(c), f);
      const float got = fp8_decode(static_cast<uint8_t>(c), f);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << c;
        EXPECT_TRUE(std::isnan(fp8_decode(fp8_encode(got, f), f)));
        continue;
      }
      EXPECT_EQ(got, want) << int(f) << " code " << c;
      if (std::isinf(want)) continue;
      if (want == 0 && c == 0x80) {
        EXPECT_EQ(fp8_encode(got, f), 0x80) << "negative zero keeps its sign";
        continue;
      }
      EXPECT_EQ(fp8_encode(got, f), c) << int(f) << " code " << c << " value " << want;
    }
  EXPECT_EQ(fp8_max(Fp8Format::E4M3), 448.0f);
  EXPECT_EQ(fp8_max(Fp8Format::E5M2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::E4M3), std::ldexp(1.0f, -9)) << "smallest E4M3 subnormal";
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::E5M2), std::ldexp(1.0f, -16)) << "smallest E5M2 subnormal";
}

TEST(Fp8, EncodingIsTheNearestValueTiesToEvenAndSaturates) {
  std::mt19937 rng(7);
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    // The finite values in order, to find each input's two neighbours.
    std::vector<double> values;
    for (int c = 0; c < 128; ++c)
      if (double v = reference(static_cast<uint8_t>(c), f); std::isfinite(v)) values.push_back(v);
    const double top = fp8_max(f);
    std::uniform_real_distribution<double> exponent(-20, std::log2(top) + 1.5), unit(0, 1);
    for (int i = 0; i < 200000; ++i) {
      const float x = static_cast<float>(std::exp2(exponent(rng)) * (unit(rng) < 0.5 ? -1 : 1));
      const double a = std::fabs(static_cast<double>(x));
      const double got = fp8_decode(fp8_encode(x, f), f);
      ASSERT_EQ(std::signbit(got), std::signbit(x)) << x;
      if (a > top) {
        // Rounds to the largest (ties to even: the largest's mantissa is even in both formats) until
        // half a quantum above it, then saturates anyway.
        EXPECT_EQ(std::fabs(got), top) << x;
        continue;
      }
      auto hi = std::lower_bound(values.begin(), values.end(), a);
      const double up = *hi, down = hi == values.begin() ? up : *(hi - 1);
      const double want = (a - down < up - a) ? down : (up - a < a - down) ? up : NAN;  // NAN: a tie
      if (std::isnan(want)) {
        // A tie between two neighbours: the one whose code is even.
        const uint8_t code = fp8_encode(x, f);
        EXPECT_EQ(code & 1, 0) << x;
        EXPECT_TRUE(std::fabs(got) == up || std::fabs(got) == down) << x;
      } else {
        EXPECT_EQ(std::fabs(got), want) << int(f) << " " << x;
      }
    }
    // Exact ties: halfway between 1 and the next value rounds to 1 (even), between the next two to the
    // even one above.
    const double q = f == Fp8Format::E4M3 ? 0.125 : 0.25;
    EXPECT_EQ(fp8_decode(fp8_encode(static_cast<float>(1 + q / 2), f), f), 1.0f);
    EXPECT_EQ(fp8_decode(fp8_encode(static_cast<float>(1 + 1.5 * q), f), f), static_cast<float>(1 + 2 * q));
    // Beyond the range and at infinity: saturate, or inf / NaN when not saturating.
    EXPECT_EQ(fp8_decode(fp8_encode(1e30f, f), f), fp8_max(f));
    EXPECT_EQ(fp8_decode(fp8_encode(-INFINITY, f), f), -fp8_max(f));
    const float unsaturated = fp8_decode(fp8_encode(1e30f, f, /*saturate=*/false), f);
    if (f == Fp8Format::E5M2)
      EXPECT_TRUE(std::isinf(unsaturated));
    else
      EXPECT_TRUE(std::isnan(unsaturated));
    EXPECT_TRUE(std::isnan(fp8_decode(fp8_encode(NAN, f), f)));
    // Below half the smallest subnormal: zero, keeping the sign.
    EXPECT_EQ(fp8_encode(-1e-30f, f), 0x80);
  }
}

}  // namespace
}  // namespace loom
