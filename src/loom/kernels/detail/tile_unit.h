// Implementation detail of Loom's bf16 kernels: the AMX tile unit, and a software one with the same
// operations. Not part of the kernels' public interface.
//
// AMX (Sapphire Rapids and later) adds eight tile registers of up to 16 rows x 64 bytes and one bf16
// product on them, TDPBF16PS: C[16][16] (f32) += A[16][32] (bf16) . B, with B stored as pairs of its
// rows -- row p of the B tile holds (B[2p][n], B[2p+1][n]) for n = 0..15, the same pairs-of-rows
// layout the AVX512-BF16 kernels already pack (one 32-bit word per pair):
//   C[m][n] += sum over p of A[m][2p] B[2p][n] + A[m][2p+1] B[2p+1][n]
// One instruction is 16 x 16 x 32 multiply-adds, 16x an AVX512-BF16 dot product's.
//
// Every tile here has one shape, 16 rows x 64 bytes (16 floats, or 16 pairs of bf16, a row), so one
// configuration serves every product. The kernels are templates on the unit:
//   * HardwareTiles issues the instructions; a kernel set using it may only run where
//     kernels::amx_tiles_ready() (the CPU has AMX, the OS gave this process the tile state, and the
//     unit passed a self-test against SoftwareTiles).
//   * SoftwareTiles computes the same thing in scalar code on a per-thread copy of the registers, so
//     that the AMX kernels' layouts, blocking and bounds are tested on CPUs without AMX; it follows
//     the instruction's definition (each product exact in f32, the two pairs' products added in
//     order, one rounding each), so it is the reference the hardware is checked against -- away
//     from denormals, which the instruction treats as zero and this unit does not.
// Tile numbers are template arguments because the instructions take them as immediates.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace loom::kernels::tile_detail {

constexpr int kTileRows = 16;   // rows of every tile
constexpr int kTileBytes = 64;  // bytes of every tile row: 16 floats, or 16 pairs of bf16

// The 64-byte operand of LDTILECFG (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Tiles 0..7 configured 16 x 64 bytes.
inline TileConfig uniform_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = kTileBytes, c.rows[t] = kTileRows;
  return c;
}

// Callers must carry the same target (a function attribute, or the bf16 kernels' target region).
#define LOOM_AMX_TARGET __attribute__((target("amx-tile,amx-bf16"), always_inline)) inline

// GCC's tile intrinsics are inline assembly that pastes the tile number into the register name, so
// each number is spelled out: `if constexpr` picks the line for T.
#define LOOM_TILE_NUMBERS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)

struct HardwareTiles {
  static constexpr bool kTiles = true;
  // GCC's tile loads (and LDTILECFG) are inline assembly with register operands only: without a
  // memory clobber the compiler may move earlier plain stores of the operands past them.
  LOOM_AMX_TARGET static void configure() {
    static const TileConfig config = uniform_config();
    __asm__ __volatile__("" ::: "memory");
    _tile_loadconfig(&config);
  }
  LOOM_AMX_TARGET static void release() { _tile_release(); }
  template <int T>
  LOOM_AMX_TARGET static void zero() {
#define LOOM_TILE_ZERO(n) \
  if constexpr (T == n) _tile_zero(n);
    LOOM_TILE_NUMBERS(LOOM_TILE_ZERO)
#undef LOOM_TILE_ZERO
  }
  // 16 rows of 64 bytes, `stride` bytes apart.
  template <int T>
  LOOM_AMX_TARGET static void load(const void* src, int64_t stride) {
    __asm__ __volatile__("" ::: "memory");  // see configure()
#define LOOM_TILE_LOAD(n) \
  if constexpr (T == n) _tile_loadd(n, src, stride);
    LOOM_TILE_NUMBERS(LOOM_TILE_LOAD)
#undef LOOM_TILE_LOAD
  }
  template <int T>
  LOOM_AMX_TARGET static void store(void* dst, int64_t stride) {
#define LOOM_TILE_STORE(n) \
  if constexpr (T == n) _tile_stored(n, dst, stride);
    LOOM_TILE_NUMBERS(LOOM_TILE_STORE)
#undef LOOM_TILE_STORE
  }
  // tile C += tile A . tile B (bf16 pairs, f32 accumulate). The operand tiles are fixed (the kernels'
  // A and B tiles, 4 and 5, or the self-test's 1 and 2); the accumulator is any of 0..3.
  template <int C, int A, int B>
  LOOM_AMX_TARGET static void dp() {
    static_assert(C >= 0 && C <= 3 && ((A == 4 && B == 5) || (A == 1 && B == 2 && C == 0)),
                  "tile numbers outside the spelled-out set");
    if constexpr (A == 1) {
      _tile_dpbf16ps(0, 1, 2);
    } else {
#define LOOM_TILE_DP(n) \
  if constexpr (C == n) _tile_dpbf16ps(n, 4, 5);
      LOOM_TILE_DP(0) LOOM_TILE_DP(1) LOOM_TILE_DP(2) LOOM_TILE_DP(3)
#undef LOOM_TILE_DP
    }
  }
};
#undef LOOM_TILE_NUMBERS

struct SoftwareTiles {
  static constexpr bool kTiles = true;
  struct Registers {
    alignas(64) unsigned char t[8][kTileRows][kTileBytes];
  };
  static Registers& regs() {
    thread_local Registers r;
    return r;
  }
  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() {
    std::memset(regs().t[T], 0, sizeof(regs().t[T]));
  }
  template <int T>
  static void load(const void* src, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(regs().t[T][r], static_cast<const unsigned char*>(src) + r * stride, kTileBytes);
  }
  template <int T>
  static void store(void* dst, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(static_cast<unsigned char*>(dst) + r * stride, regs().t[T][r], kTileBytes);
  }
  static float widen(uint16_t h) {
    const uint32_t bits = uint32_t{h} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  template <int C, int A, int B>
  static void dp() {
    Registers& g = regs();
    for (int m = 0; m < kTileRows; ++m) {
      float c[16];
      std::memcpy(c, g.t[C][m], sizeof c);
      uint16_t a[32];
      std::memcpy(a, g.t[A][m], sizeof a);
      for (int p = 0; p < 16; ++p) {
        uint16_t b[32];
        std::memcpy(b, g.t[B][p], sizeof b);
        for (int n = 0; n < 16; ++n) {
          c[n] += widen(a[2 * p]) * widen(b[2 * n]);
          c[n] += widen(a[2 * p + 1]) * widen(b[2 * n + 1]);
        }
      }
      std::memcpy(g.t[C][m], c, sizeof c);
    }
  }
};

// The AVX512-BF16 kernels' stand-in: no tile unit.
struct NoTiles {
  static constexpr bool kTiles = false;
  static void configure() {}
  static void release() {}
};

// Loads the unit's configuration for this thread and releases the tile state when the scope ends
// (AMX-targeted like the unit: use it inside AMX-targeted code).
// Per call, not once per thread: oneDNN's AMX GEMMs configure the same registers their own way.
template <class U>
struct TileScope {
  LOOM_AMX_TARGET TileScope() { U::configure(); }
  LOOM_AMX_TARGET ~TileScope() { U::release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace loom::kernels::tile_detail
