// What the CPU can do, read once at run time. Loom is built for any x86-64 (no -march=native): the
// fast paths are chosen here and by oneDNN, and the choice is reported at start-up.
#pragma once

#include <string>

namespace loom {

// Instruction sets Loom's own kernels (attention, element-wise) are written for, in increasing order.
enum class KernelIsa { Sse2, Avx2, Avx512, Avx512Bf16, Amx };
const char* kernel_isa_name(KernelIsa isa);  // "sse2", "avx2", "avx512", "avx512_bf16", "amx"

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
  bool amx_tile = false;
  std::string model_name;

  static const CpuFeatures& detect();
  // Best vector ISA Loom's own kernels use on this machine: "avx512", "avx2" or "scalar".
  std::string vector_isa() const;
  // One line for start-up logs: model, ISA flags.
  std::string summary() const;
  // The best ISA this CPU offers Loom's kernels.
  KernelIsa best_kernel_isa() const;
  // best_kernel_isa() capped by LOOM_MAX_CPU_ISA (sse2 | avx2 | avx512 | avx512_bf16 | amx), or when
  // that is unset by oneDNN's DNNL_MAX_CPU_ISA (so one switch restricts oneDNN and Loom alike): every
  // kernel path can be forced, and so tested, on a machine that can run it. An unknown
  // LOOM_MAX_CPU_ISA value throws, naming the valid ones.
  KernelIsa kernel_isa() const;
};

}  // namespace loom
