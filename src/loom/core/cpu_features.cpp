#include "loom/core/cpu_features.h"

#include <cpuid.h>

#include <fstream>
#include <string>

namespace loom {

namespace {
// XCR0 tells whether the OS saves the wide registers; without it the CPUID bits are not usable.
uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures probe() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = (c >> 27) & 1;
  f.fma = (c >> 12) & 1;
  uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  bool ymm_ok = (xcr0 & 0x6) == 0x6;
  bool zmm_ok = (xcr0 & 0xe6) == 0xe6;
  bool tile_ok = (xcr0 & 0x60000) == 0x60000;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = ymm_ok && ((b >> 5) & 1);
    f.avx512f = zmm_ok && ((b >> 16) & 1);
    f.avx512bw = zmm_ok && ((b >> 30) & 1);
    f.amx_bf16 = tile_ok && ((d >> 22) & 1);
    f.amx_tile = tile_ok && ((d >> 24) & 1);
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = zmm_ok && ((a >> 5) & 1);
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto p = line.find(':');
      if (p != std::string::npos) f.model_name = line.substr(p + 2);
      break;
    }
  }
  return f;
}
}  // namespace

const CpuFeatures& CpuFeatures::detect() {
  static const CpuFeatures features = probe();
  return features;
}

std::string CpuFeatures::vector_isa() const {
  if (avx512f && avx512bw) return "avx512";
  if (avx2 && fma) return "avx2";
  return "scalar";
}

std::string CpuFeatures::summary() const {
  std::string s = model_name.empty() ? "x86-64" : model_name;
  s += " [";
  s += avx2 ? "avx2 " : "";
  s += avx512f ? "avx512f " : "";
  s += avx512_bf16 ? "avx512_bf16 " : "";
  s += amx_bf16 ? "amx_bf16 " : "";
  if (s.back() == ' ') s.pop_back();
  return s + "]";
}

}  // namespace loom
