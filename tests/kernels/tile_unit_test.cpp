// The tile units the bf16 attention's AMX kernels run on (kernels/detail/tile_unit.h): the software
// unit against the instruction's definition in float64, and -- where the CPU has AMX and Loom may use
// it -- the hardware against the software unit on random operands.
#include "loom/kernels/detail/tile_unit.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "loom/kernels/amx_tiles.h"

namespace loom::kernels::tile_detail {
namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
double widen(uint16_t h) { return SoftwareTiles::widen(h); }

// C (16 x 16, row stride ldc floats) = C0 (+) A (16 x 32 bf16, row stride lda words of 2 bf16) . B
// (16 pair rows x 16 columns, row stride ldb words), run on unit U.
template <class U>
__attribute__((target("amx-tile,amx-bf16"))) void run(float* c, int64_t ldc, bool accumulate, const uint32_t* a,
                                                        int64_t lda, const uint32_t* b, int64_t ldb) {
  TileScope<U> scope;
  if (accumulate) U::template load<2>(c, ldc * 4);
  else U::template zero<2>();
  U::template load<4>(a, lda * 4);
  U::template load<5>(b, ldb * 4);
  U::template dp<2, 4, 5>();
  U::template store<2>(c, ldc * 4);
}

struct Operands {
  int64_t lda = 19, ldb = 21, ldc = 23;  // strides wider than a tile row: rows must be read at them
  std::vector<uint32_t> a, b;
  std::vector<float> c0;
};
Operands random_operands(std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Operands o;
  auto words = [&](int64_t rows, int64_t ld) {
    std::vector<uint32_t> v(static_cast<size_t>(rows * ld));
    for (auto& w : v) w = uint32_t{to_bf16(dist(rng))} | (uint32_t{to_bf16(dist(rng))} << 16);
    return v;
  };
  o.a = words(16, o.lda), o.b = words(16, o.ldb);
  o.c0.resize(static_cast<size_t>(16 * o.ldc));
  for (auto& x : o.c0) x = dist(rng);
  return o;
}

TEST(TileUnit, SoftwareUnitComputesTheInstructionsProduct) {
  std::mt19937 rng(7);
  for (bool accumulate : {false, true}) {
    Operands o = random_operands(rng);
    std::vector<float> c = o.c0;
    run<SoftwareTiles>(c.data(), o.ldc, accumulate, o.a.data(), o.lda, o.b.data(), o.ldb);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        double want = accumulate ? o.c0[m * o.ldc + n] : 0.0, scale = std::abs(want);
        for (int p = 0; p < 16; ++p)
          for (int half = 0; half < 2; ++half) {
            const double x = widen(static_cast<uint16_t>(o.a[m * o.lda + p] >> (16 * half))) *
                             widen(static_cast<uint16_t>(o.b[p * o.ldb + n] >> (16 * half)));
            want += x, scale += std::abs(x);
          }
        EXPECT_NEAR(c[m * o.ldc + n], want, 1e-6 * scale) << m << "," << n << (accumulate ? " accumulating" : "");
      }
    // Past each row's 16 floats the strided store left C alone.
    for (int m = 0; m < 16; ++m)
      for (int64_t n = 16; n < o.ldc; ++n) EXPECT_EQ(c[m * o.ldc + n], o.c0[m * o.ldc + n]);
  }
}

TEST(TileUnit, HardwareMatchesTheSoftwareUnitWhereLoomUsesAmx) {
  if (!amx_tiles_status().ready) GTEST_SKIP() << "AMX tiles unused here: " << amx_tiles_status().detail;
  std::mt19937 rng(11);
  for (int draw = 0; draw < 20; ++draw) {
    Operands o = random_operands(rng);
    for (bool accumulate : {false, true}) {
      std::vector<float> hw = o.c0, sw = o.c0;
      run<HardwareTiles>(hw.data(), o.ldc, accumulate, o.a.data(), o.lda, o.b.data(), o.ldb);
      run<SoftwareTiles>(sw.data(), o.ldc, accumulate, o.a.data(), o.lda, o.b.data(), o.ldb);
      for (size_t i = 0; i < hw.size(); ++i)
        EXPECT_NEAR(hw[i], sw[i], 1e-5 * (1 + std::abs(sw[i]))) << "draw " << draw << " element " << i;
    }
  }
}

}  // namespace
}  // namespace loom::kernels::tile_detail
