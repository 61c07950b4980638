#include "loom/kernels/amx_tiles.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "loom/core/cpu_features.h"
#include "loom/kernels/detail/tile_unit.h"

namespace loom::kernels {
namespace {

using tile_detail::HardwareTiles;
using tile_detail::SoftwareTiles;

// Linux's arch_prctl codes for dynamically enabled XSAVE state (asm/prctl.h, 5.16+), spelled out so
// the build does not depend on the kernel headers' age.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtileData = 18;

// C = A . B on both units, 16 x 16 x 32, from values whose products and sums are exact in f32 (small
// integers): the hardware must agree bit for bit.
template <class U>
__attribute__((target("amx-tile,amx-bf16"))) void product(float* c, const uint16_t* a, const uint16_t* b) {
  tile_detail::TileScope<U> scope;
  U::template zero<0>();
  U::template load<1>(a, 64);
  U::template load<2>(b, 64);
  U::template dp<0, 1, 2>();
  U::template store<0>(c, 64);
}

uint16_t bf16_of_int(int v) {
  const float f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);  // exact: small integers need few mantissa bits
}

AmxTilesStatus check() {
  const CpuFeatures& cpu = CpuFeatures::detect();
  if (!cpu.amx_tile || !cpu.amx_bf16) return {false, "no AMX on this CPU (or the OS has not enabled its state)"};
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) != 0)
    return {false, "the OS refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: " +
                       std::string(std::strerror(errno)) + ")"};
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) a[i] = bf16_of_int(i % 7 - 3), b[i] = bf16_of_int((i * 5) % 9 - 4);
  alignas(64) float hw[256], sw[256];
  product<HardwareTiles>(hw, a, b);
  product<SoftwareTiles>(sw, a, b);
  if (std::memcmp(hw, sw, sizeof hw) != 0)
    return {false, "the AMX self-test product differed from the software tile unit (Loom bug: tile layout)"};
  return {true, "ready"};
}

}  // namespace

const AmxTilesStatus& amx_tiles_status() {
  static const AmxTilesStatus status = check();
  return status;
}

}  // namespace loom::kernels
