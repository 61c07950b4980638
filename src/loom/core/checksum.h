// A fast 64-bit content checksum for tensors and shards (detects corruption, not adversaries):
// 8-byte words mixed with multiply-xorshift (the finaliser of splitmix64) and folded in order, then
// the tail bytes and the length. ~10 GB/s on one core, so checking a checkpoint costs little.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace loom {

inline uint64_t checksum64(const void* data, size_t n) {
  auto mix = [](uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  const auto* p = static_cast<const unsigned char*>(data);
  // Four independent lanes keep the multiplier pipeline busy; combined in a fixed order.
  uint64_t lane[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = mix(lane[k] ^ w) + 0x9e3779b97f4a7c15ull;
    }
  uint64_t h = mix(lane[0] ^ mix(lane[1] ^ mix(lane[2] ^ mix(lane[3]))));
  for (; i < n; ++i) h = mix(h ^ p[i]) + i;
  return mix(h ^ static_cast<uint64_t>(n));
}

inline std::string checksum_hex(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 15];
  return s;
}

}  // namespace loom
