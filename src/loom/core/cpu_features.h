// What the CPU can do, read once at run time. Loom is built for any x86-64 (no -march=native): the
// fast paths are chosen here and by oneDNN, and the choice is reported at start-up.
#pragma once

#include <string>

namespace loom {

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
};

}  // namespace loom
