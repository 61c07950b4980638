// Element-wise reductions that collectives apply to received data: a fixed order of operands (so every
// rank computes bitwise the same values), bf16 accumulated in f32 and rounded once, AVX-512 / AVX2
// picked at run time.
#pragma once

#include <cstddef>
#include <span>

#include "loom/comm/collective.h"

namespace loom::comm {

// The type partial sums travel in: f32 for bf16 (so a ring does not round at every hop), else the type.
DType accumulator_type(DType t);

// dst[i] = finish(srcs[0][i] op srcs[1][i] op ... ), operands in the order given. kAvg divides by
// `divisor`. dst may alias srcs[0].
void reduce_sources(void* dst, std::span<const void* const> srcs, size_t count, DType dtype, ReduceOp op, int divisor);

// One hop of a ring reduction. `acc_in` (accumulator type, or nullptr on the first hop) op `src`
// (dtype) goes to `out`: in the accumulator type when `finish` is false, else in dtype with kAvg
// divided by `divisor`. out may alias acc_in.
void reduce_hop(void* out, const void* acc_in, const void* src, size_t count, DType dtype, ReduceOp op, bool finish,
                int divisor);

// Throws CommError when `op` is not defined on `dtype` (avg of integers).
void check_reduce(DType dtype, ReduceOp op);

}  // namespace loom::comm
