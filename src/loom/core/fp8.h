// FP8 numbers as the OCP 8-bit floating point specification (and NVIDIA's Transformer Engine, AMD,
// Trainium) define them: E4M3 (4 exponent bits, bias 7, 3 mantissa bits; no infinity, S.1111.111 is
// NaN; largest finite 448) for activations and weights, E5M2 (bias 15, IEEE-like with infinities;
// largest finite 57344) for gradients. Conversion from f32 rounds to nearest, ties to even, with
// subnormals; out of range it saturates to the largest finite value (the "satfinite" cast the fp8
// recipes use) or, when asked, gives infinity (E5M2) / NaN (E4M3). The building block of the fp8
// recipes (issue 16 item 2): scaling, amax histories and the emulated GEMMs come on top of it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace loom {

enum class Fp8Format : uint8_t { E4M3, E5M2 };

namespace fp8_detail {

struct Layout {
  int exponent_bits, mantissa_bits, bias;
  bool has_infinity;  // E5M2: exponent all ones is inf (mantissa 0) / NaN; E4M3: only S.1111.111 is NaN
};

constexpr Layout layout(Fp8Format f) {
  return f == Fp8Format::E4M3 ? Layout{4, 3, 7, false} : Layout{5, 2, 15, true};
}

}  // namespace fp8_detail

// The largest finite value: 448 (E4M3), 57344 (E5M2).
constexpr float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0f : 57344.0f; }

inline float fp8_decode(uint8_t code, Fp8Format f) {
  const auto L = fp8_detail::layout(f);
  const bool negative = code & 0x80;
  const int e = (code >> L.mantissa_bits) & ((1 << L.exponent_bits) - 1);
  const int m = code & ((1 << L.mantissa_bits) - 1);
  const int e_max = (1 << L.exponent_bits) - 1, m_max = (1 << L.mantissa_bits) - 1;
  float v;
  if (L.has_infinity && e == e_max)
    v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  else if (!L.has_infinity && e == e_max && m == m_max)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0)  // subnormal: m x 2^(1 - bias - mantissa_bits)
    v = std::ldexp(static_cast<float>(m), 1 - L.bias - L.mantissa_bits);
  else
    v = std::ldexp(static_cast<float>(m + (1 << L.mantissa_bits)), e - L.bias - L.mantissa_bits);
  return negative ? -v : v;
}

// Round to nearest, ties to even. saturate: beyond the largest finite value (after rounding), and
// infinities, give the largest finite value of the same sign; else infinity (E5M2) or NaN (E4M3).
// NaN gives NaN.
inline uint8_t fp8_encode(float x, Fp8Format f, bool saturate = true) {
  const auto L = fp8_detail::layout(f);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const int e_max = (1 << L.exponent_bits) - 1, m_max = (1 << L.mantissa_bits) - 1;
  const uint8_t nan = static_cast<uint8_t>(0x7f);  // E4M3: S.1111.111; E5M2: S.11111.11
  if (std::isnan(x)) return nan;
  // The largest finite code: E4M3 1111.110, E5M2 11110.11.
  const uint8_t max_code = L.has_infinity ? static_cast<uint8_t>(((e_max - 1) << L.mantissa_bits) | m_max)
                                          : static_cast<uint8_t>((e_max << L.mantissa_bits) | (m_max - 1));
  const uint8_t overflow = saturate ? max_code : L.has_infinity ? static_cast<uint8_t>(e_max << L.mantissa_bits) : nan;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(x)) return sign | overflow;
  if (a == 0) return sign;
  // The quantum of a's binade (or of the subnormals below the smallest normal), then an exact
  // power-of-two scaling and a round to nearest even (the default rounding mode).
  int exponent = 0;
  std::frexp(a, &exponent);  // a = frac x 2^exponent, frac in [0.5, 1): a's binade starts at 2^(exponent - 1)
  const int min_normal = 1 - L.bias;
  const int binade = std::max(exponent - 1, min_normal);
  const double quantum = std::ldexp(1.0, binade - L.mantissa_bits);
  const double q = std::nearbyint(a / quantum);  // mantissa with its leading one, in quanta
  const double value = q * quantum;
  if (value > static_cast<double>(fp8_max(f))) return sign | overflow;
  if (q < (1 << L.mantissa_bits)) return sign | static_cast<uint8_t>(q);  // subnormal (or zero)
  // q may have rounded up to the next binade (2^(M+1)): the code's exponent field then counts it.
  int e = binade + L.bias, m = static_cast<int>(q) - (1 << L.mantissa_bits);
  if (m > m_max) ++e, m = 0;
  return sign | static_cast<uint8_t>((e << L.mantissa_bits) | m);
}

}  // namespace loom
