// This machine's streaming memory bandwidth, the memory roof of `loom calibrate`, `loom profile report`
// and bench/kernels_bench: STREAM's triad a = b + s * c over three arrays of `array_bytes`, parallel
// over the compute threads and first-touched by them, best of `passes` after a warm-up pass, counting
// three arrays' bytes a pass (STREAM's convention; write-allocate traffic is not counted).
#pragma once

#include <cstddef>

namespace loom::kernels {

double stream_triad_bandwidth(size_t array_bytes, int passes);

}  // namespace loom::kernels
