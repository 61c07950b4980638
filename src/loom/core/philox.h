// Counter-based RNG (Philox-4x32-10, Salmon et al. 2011). Any element's random value is a pure
// function of (seed, stream, index): initialisation, dropout and stochastic rounding therefore do
// not depend on how a tensor is sharded or in which order elements are visited.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>

namespace loom {

class Philox {
 public:
  // Four 32-bit outputs for counter (index, stream) under key (seed).
  static std::array<uint32_t, 4> block(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t c0 = static_cast<uint32_t>(index), c1 = static_cast<uint32_t>(index >> 32);
    uint32_t c2 = static_cast<uint32_t>(stream), c3 = static_cast<uint32_t>(stream >> 32);
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
      uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
      uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c1 = static_cast<uint32_t>(p1);
      c3 = static_cast<uint32_t>(p0);
      c0 = n0;
      c2 = n2;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return {c0, c1, c2, c3};
  }

  static uint32_t u32(uint64_t seed, uint64_t stream, uint64_t index) { return block(seed, stream, index)[0]; }

  // Uniform in (0, 1): never exactly 0, so log() is safe.
  static float uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    return (static_cast<float>(u32(seed, stream, index) >> 8) + 0.5f) * (1.0f / 16777216.0f);
  }

  // Standard normal by Box-Muller on one Philox block.
  static float normal(uint64_t seed, uint64_t stream, uint64_t index) {
    auto b = block(seed, stream, index);
    double u1 = (static_cast<double>(b[0]) + 0.5) / 4294967296.0;
    double u2 = (static_cast<double>(b[1]) + 0.5) / 4294967296.0;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

// Stable 64-bit stream id for a name (FNV-1a): initialisation is keyed by parameter name.
constexpr uint64_t stream_of(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace loom
