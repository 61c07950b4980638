// f32 <-> bf16 conversion: round-to-nearest-even for storage, stochastic rounding keyed by a
// counter-based random value so that a rounded tensor is the same whatever the sharding.
#pragma once

#include <cstdint>
#include <cstring>

namespace loom {

struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even; NaN stays a (quiet) NaN.
inline bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// Stochastic rounding: adds 16 random low bits before truncating, so E[round(x)] = x.
// `random16` must be uniform in [0, 2^16); pass Philox output keyed by the element's global index.
inline bf16 f32_to_bf16_stochastic(float f, uint32_t random16) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f32_to_bf16(f);  // Inf/NaN unchanged
  u += (random16 & 0xffffu);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

}  // namespace loom
