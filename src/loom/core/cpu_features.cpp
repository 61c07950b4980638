#include "loom/core/cpu_features.h"

#include <cpuid.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <string>

#include "loom/error.h"

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
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// oneDNN's names (SSE41, AVX2, AVX512_CORE, AVX512_CORE_BF16, AVX512_CORE_AMX, ALL, ...) mapped to the
// kernels Loom has for them; oneDNN ignores a value it does not know, and so does this.
KernelIsa from_dnnl(std::string v) {
  v = lower(v);
  if (v.find("amx") != std::string::npos) return KernelIsa::Amx;
  if (v.find("avx512") != std::string::npos)
    return v.find("bf16") != std::string::npos || v.find("fp16") != std::string::npos ? KernelIsa::Avx512Bf16
                                                                                     : KernelIsa::Avx512;
  if (v.find("avx2") != std::string::npos) return KernelIsa::Avx2;
  if (v == "sse41" || v == "avx") return KernelIsa::Sse2;
  return KernelIsa::Amx;
}

KernelIsa isa_cap() {
  if (const char* env = std::getenv("LOOM_MAX_CPU_ISA"); env != nullptr && *env != '\0') {
    const std::string v = lower(env);
    for (KernelIsa isa : {KernelIsa::Sse2, KernelIsa::Avx2, KernelIsa::Avx512, KernelIsa::Avx512Bf16, KernelIsa::Amx})
      if (v == kernel_isa_name(isa)) return isa;
    throw Error("LOOM_MAX_CPU_ISA=" + std::string(env) +
                " is not an instruction set Loom's kernels know: use sse2, avx2, avx512, avx512_bf16 or amx");
  }
  if (const char* env = std::getenv("DNNL_MAX_CPU_ISA"); env != nullptr && *env != '\0') return from_dnnl(env);
  return KernelIsa::Amx;
}
}  // namespace

const char* kernel_isa_name(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::Sse2: return "sse2";
    case KernelIsa::Avx2: return "avx2";
    case KernelIsa::Avx512: return "avx512";
    case KernelIsa::Avx512Bf16: return "avx512_bf16";
    case KernelIsa::Amx: return "amx";
  }
  return "?";
}

KernelIsa CpuFeatures::best_kernel_isa() const {
  if (avx512f && avx512bw && fma) {
    if (avx512_bf16) return amx_bf16 && amx_tile ? KernelIsa::Amx : KernelIsa::Avx512Bf16;
    return KernelIsa::Avx512;
  }
  if (avx2 && fma) return KernelIsa::Avx2;
  return KernelIsa::Sse2;
}

KernelIsa CpuFeatures::kernel_isa() const { return std::min(best_kernel_isa(), isa_cap()); }

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
