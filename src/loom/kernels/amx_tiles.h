// Whether Loom's own kernels may use the AMX tile unit in this process.
#pragma once

#include <string>

namespace loom::kernels {

// Checked once per process, in this order: the CPU offers AMX-TILE and AMX-BF16 and the OS enabled
// their state (CpuFeatures), Linux granted this process the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM; without it the first tile instruction faults), and a self-test product on the
// tiles matched the software tile unit. LOOM_MAX_CPU_ISA below amx is not considered here (callers
// cap by CpuFeatures::kernel_isa()).
struct AmxTilesStatus {
  bool ready = false;
  std::string detail;  // "ready", or what failed: "no AMX on this CPU", "the OS refused ...", ...
};
const AmxTilesStatus& amx_tiles_status();

}  // namespace loom::kernels
