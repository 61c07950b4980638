// The device peak MFU is measured against: the best oneDNN GEMM rate over 1024^3, 2048^3 and 4096^3
// products in a dtype, at the current thread count. Measured once per (CPU, threads, dtype) and
// cached on disk, so every run and `loom calibrate` agree on the same denominator.
#pragma once

#include <string>

#include "loom/core/dtype.h"

namespace loom::kernels {

struct PeakFlops {
  double flops_per_s = 0;
  std::string source;  // "measured", "cache <path>" or "LOOM_PEAK_FLOPS"
};

// Honours LOOM_PEAK_FLOPS (a number, FLOP/s) to skip the probe; caches under $LOOM_CACHE_DIR, else
// $XDG_CACHE_HOME/loom, else ~/.cache/loom.
PeakFlops device_peak_flops(DType dtype, int threads);

// Removes the cached value, so the next device_peak_flops() measures again (a peak measured on a
// busy machine is too low and inflates every MFU after it).
void forget_cached_peak(DType dtype, int threads);

// The probe itself, uncached: best rate over the three cube sizes (a warm-up and two timed runs each).
double measure_gemm_peak(DType dtype);

}  // namespace loom::kernels
