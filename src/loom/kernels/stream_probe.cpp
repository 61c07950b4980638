#include "loom/kernels/stream_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>

namespace loom::kernels {

double stream_triad_bandwidth(size_t array_bytes, int passes) {
  const int64_t n = static_cast<int64_t>(array_bytes / sizeof(double));
  if (n <= 0) return 0;
  std::unique_ptr<double[]> a(new double[static_cast<size_t>(n)]), b(new double[static_cast<size_t>(n)]),
      c(new double[static_cast<size_t>(n)]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = 0, b[i] = 1.0 + static_cast<double>(i % 7), c[i] = 2.0 - static_cast<double>(i % 5);
  double best = 0;
  for (int p = 0; p < passes + 1; ++p) {
    const double s = 1.0 + p * 1e-3;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (p > 0) best = std::max(best, 3.0 * static_cast<double>(n) * sizeof(double) / t);  // pass 0 warms up
  }
  if (a[static_cast<size_t>(n / 2)] == -1) best = 0;  // keeps the stores observable
  return best;
}

}  // namespace loom::kernels
