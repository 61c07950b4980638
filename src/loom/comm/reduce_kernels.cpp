#include "loom/comm/reduce_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "loom/core/bf16.h"
#include "loom/error.h"

#define LOOM_COMM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define LOOM_COMM_INLINE inline __attribute__((always_inline))

namespace loom::comm {

namespace {

// Storage type T, accumulator type A.
template <class T>
struct Traits {
  using A = T;
  static LOOM_COMM_INLINE A load(T v) { return v; }
  static LOOM_COMM_INLINE T store(A v) { return v; }
};
template <>
struct Traits<bf16> {
  using A = float;
  static LOOM_COMM_INLINE float load(bf16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static LOOM_COMM_INLINE bf16 store(float f) { return f32_to_bf16(f); }
};

template <class A>
LOOM_COMM_INLINE A combine(A a, A b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return a > b ? a : b;
    case ReduceOp::kMin: return a < b ? a : b;
    default:
      if constexpr (std::is_integral_v<A>) {
        // Wrap-around instead of undefined behaviour on overflow.
        using U = std::make_unsigned_t<A>;
        return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
      } else {
        return a + b;
      }
  }
}

// Blocked so that the inner loops are plain streams the compiler vectorises, whatever the number
// of sources; the block of partial results stays in L1.
template <class T, ReduceOp OP>
LOOM_COMM_INLINE void reduce_sources_t(T* dst, const void* const* srcs, int nsrc, size_t count, int divisor) {
  using Tr = Traits<T>;
  using A = typename Tr::A;
  constexpr size_t kBlock = 2048;
  alignas(64) A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = Tr::load(s0[i]);
    for (int s = 1; s < nsrc; ++s) {
      const T* p = static_cast<const T*>(srcs[s]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = combine<A>(acc[i], Tr::load(p[i]), OP);
    }
    if constexpr (OP == ReduceOp::kAvg && !std::is_integral_v<A>) {
      const A inv = static_cast<A>(1) / static_cast<A>(divisor);
      // Multiply, not divide: the same on every rank, and what torch's AVG does for floats.
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] * inv;
    }
    T* d = dst + base;
    for (size_t i = 0; i < m; ++i) d[i] = Tr::store(acc[i]);
  }
}

template <class T, ReduceOp OP>
LOOM_COMM_INLINE void reduce_hop_t(void* out, const void* acc_in, const T* src, size_t count, bool finish,
                                   int divisor) {
  using Tr = Traits<T>;
  using A = typename Tr::A;
  const A* in = static_cast<const A*>(acc_in);
  if (!finish) {
    A* o = static_cast<A*>(out);
    if (in) {
      for (size_t i = 0; i < count; ++i) o[i] = combine<A>(in[i], Tr::load(src[i]), OP);
    } else {
      for (size_t i = 0; i < count; ++i) o[i] = Tr::load(src[i]);
    }
    return;
  }
  T* o = static_cast<T*>(out);
  A inv = static_cast<A>(1);
  if constexpr (!std::is_integral_v<A>) inv = static_cast<A>(1) / static_cast<A>(divisor);
  for (size_t i = 0; i < count; ++i) {
    A v = in ? combine<A>(in[i], Tr::load(src[i]), OP) : Tr::load(src[i]);
    if constexpr (OP == ReduceOp::kAvg && !std::is_integral_v<A>) v = v * inv;
    o[i] = Tr::store(v);
  }
}

template <class T>
LOOM_COMM_INLINE void sources_dispatch(void* dst, const void* const* srcs, int nsrc, size_t count, ReduceOp op,
                                       int divisor) {
  T* d = static_cast<T*>(dst);
  switch (op) {
    case ReduceOp::kSum: reduce_sources_t<T, ReduceOp::kSum>(d, srcs, nsrc, count, divisor); break;
    case ReduceOp::kAvg: reduce_sources_t<T, ReduceOp::kAvg>(d, srcs, nsrc, count, divisor); break;
    case ReduceOp::kMax: reduce_sources_t<T, ReduceOp::kMax>(d, srcs, nsrc, count, divisor); break;
    case ReduceOp::kMin: reduce_sources_t<T, ReduceOp::kMin>(d, srcs, nsrc, count, divisor); break;
  }
}

template <class T>
LOOM_COMM_INLINE void hop_dispatch(void* out, const void* acc_in, const void* src, size_t count, ReduceOp op,
                                   bool finish, int divisor) {
  const T* s = static_cast<const T*>(src);
  switch (op) {
    case ReduceOp::kSum: reduce_hop_t<T, ReduceOp::kSum>(out, acc_in, s, count, finish, divisor); break;
    case ReduceOp::kAvg: reduce_hop_t<T, ReduceOp::kAvg>(out, acc_in, s, count, finish, divisor); break;
    case ReduceOp::kMax: reduce_hop_t<T, ReduceOp::kMax>(out, acc_in, s, count, finish, divisor); break;
    case ReduceOp::kMin: reduce_hop_t<T, ReduceOp::kMin>(out, acc_in, s, count, finish, divisor); break;
  }
}

LOOM_COMM_CLONES void sources_any(void* dst, const void* const* srcs, int nsrc, size_t count, DType dtype, ReduceOp op,
                                  int divisor) {
  switch (dtype) {
    case DType::F32: sources_dispatch<float>(dst, srcs, nsrc, count, op, divisor); break;
    case DType::F64: sources_dispatch<double>(dst, srcs, nsrc, count, op, divisor); break;
    case DType::BF16: sources_dispatch<bf16>(dst, srcs, nsrc, count, op, divisor); break;
    case DType::I32: sources_dispatch<int32_t>(dst, srcs, nsrc, count, op, divisor); break;
    case DType::I64: sources_dispatch<int64_t>(dst, srcs, nsrc, count, op, divisor); break;
  }
}

LOOM_COMM_CLONES void hop_any(void* out, const void* acc_in, const void* src, size_t count, DType dtype, ReduceOp op,
                              bool finish, int divisor) {
  switch (dtype) {
    case DType::F32: hop_dispatch<float>(out, acc_in, src, count, op, finish, divisor); break;
    case DType::F64: hop_dispatch<double>(out, acc_in, src, count, op, finish, divisor); break;
    case DType::BF16: hop_dispatch<bf16>(out, acc_in, src, count, op, finish, divisor); break;
    case DType::I32: hop_dispatch<int32_t>(out, acc_in, src, count, op, finish, divisor); break;
    case DType::I64: hop_dispatch<int64_t>(out, acc_in, src, count, op, finish, divisor); break;
  }
}

}  // namespace

DType accumulator_type(DType t) { return t == DType::BF16 ? DType::F32 : t; }

void check_reduce(DType dtype, ReduceOp op) {
  if (op == ReduceOp::kAvg && (dtype == DType::I32 || dtype == DType::I64))
    throw CommError(std::string("reduce op avg is not defined for integer type ") + std::string(dtype_name(dtype)) +
                    ": use sum and divide, or a float type");
}

void reduce_sources(void* dst, std::span<const void* const> srcs, size_t count, DType dtype, ReduceOp op, int divisor) {
  if (count == 0 || srcs.empty()) return;
  sources_any(dst, srcs.data(), static_cast<int>(srcs.size()), count, dtype, op, divisor);
}

void reduce_hop(void* out, const void* acc_in, const void* src, size_t count, DType dtype, ReduceOp op, bool finish,
                int divisor) {
  if (count == 0) return;
  hop_any(out, acc_in, src, count, dtype, op, finish, divisor);
}

}  // namespace loom::comm
