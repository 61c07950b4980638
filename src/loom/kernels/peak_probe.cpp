#include "loom/kernels/peak_probe.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/cpu_features.h"
#include "loom/kernels/gemm.h"

namespace loom::kernels {

namespace fs = std::filesystem;

double measure_gemm_peak(DType dtype) {
  Allocator alloc;
  double best = 0;
  for (int64_t n : {1024, 2048, 4096}) {
    GemmDesc d{.M = n, .N = n, .K = n, .ab_type = dtype};
    size_t elt = dtype_size(dtype);
    Buffer a(alloc, elt * n * n, MemCategory::Workspace), b(alloc, elt * n * n, MemCategory::Workspace);
    Buffer c(alloc, sizeof(float) * n * n, MemCategory::Workspace);
    // Small non-zero values: denormals or zeros could make some hardware paths unrepresentative.
    std::vector<unsigned char> pattern(elt * n * n);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>((i * 7 + 3) % 61 + 1);
    for (size_t i = 1; i < pattern.size(); i += elt) pattern[i + (elt - 2)] = 0x3c;  // exponent near 1
    std::memcpy(a.data(), pattern.data(), pattern.size());
    std::memcpy(b.data(), pattern.data(), pattern.size());
    for (int rep = 0; rep < 3; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      gemm(d, a.data(), b.data(), static_cast<float*>(c.data()), nullptr, alloc);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) best = std::max(best, gemm_cost(d).flops / s);
    }
  }
  return best;
}

namespace {
fs::path cache_dir() {
  if (const char* d = std::getenv("LOOM_CACHE_DIR")) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME")) return fs::path(x) / "loom";
  if (const char* h = std::getenv("HOME")) return fs::path(h) / ".cache" / "loom";
  return fs::temp_directory_path() / "loom-cache";
}

std::string cache_key(DType dtype, int threads) {
  std::string model = CpuFeatures::detect().model_name;
  for (auto& ch : model)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  const char* isa = std::getenv("DNNL_MAX_CPU_ISA");
  return "peak-" + model + "-" + std::string(dtype_name(dtype)) + "-t" + std::to_string(threads) +
         (isa ? std::string("-") + isa : "") + ".txt";
}
}  // namespace

void forget_cached_peak(DType dtype, int threads) {
  std::error_code ec;
  fs::remove(cache_dir() / cache_key(dtype, threads), ec);
}

PeakFlops device_peak_flops(DType dtype, int threads) {
  if (const char* env = std::getenv("LOOM_PEAK_FLOPS")) {
    double v = std::atof(env);
    if (v > 0) return {v, "LOOM_PEAK_FLOPS"};
  }
  fs::path path = cache_dir() / cache_key(dtype, threads);
  {
    std::ifstream in(path);
    double v = 0;
    if (in >> v && v > 0) return {v, "cache " + path.string()};
  }
  double v = measure_gemm_peak(dtype);
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  // Written to a temporary name and renamed, so a concurrent reader never sees half a number.
  fs::path tmp = path;
  tmp += ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp);
    out << v << "\n";
  }
  fs::rename(tmp, path, ec);
  return {v, "measured"};
}

}  // namespace loom::kernels
