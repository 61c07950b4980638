// Which loops the element-wise kernels with an AVX-512 form run (elementwise.h, ElementwisePath).
#include <atomic>
#include <string>

#include "loom/core/cpu_features.h"
#include "loom/error.h"
#include "loom/kernels/detail/elementwise_avx512.h"
#include "loom/kernels/elementwise.h"

namespace loom::kernels {
namespace {

bool path_supported(ElementwisePath p) {
  return p == ElementwisePath::Portable || CpuFeatures::detect().kernel_isa() >= KernelIsa::Avx512;
}

// -1: not forced; else the forced ElementwisePath.
std::atomic<int> g_forced_path{-1};

}  // namespace

bool detail::elementwise_avx512() {
  static const bool detected = path_supported(ElementwisePath::Avx512);
  const int forced = g_forced_path.load(std::memory_order_relaxed);
  return forced < 0 ? detected : forced == static_cast<int>(ElementwisePath::Avx512);
}

const char* elementwise_path_name(ElementwisePath p) { return p == ElementwisePath::Avx512 ? "avx512" : "portable"; }

ElementwisePath elementwise_path() {
  return detail::elementwise_avx512() ? ElementwisePath::Avx512 : ElementwisePath::Portable;
}

void force_elementwise_path(std::optional<ElementwisePath> p) {
  if (p && !path_supported(*p))
    throw Error(std::string("element-wise kernels: the ") + elementwise_path_name(*p) +
                " path needs AVX-512F, which this CPU (capped by LOOM_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) lacks");
  g_forced_path.store(p ? static_cast<int>(*p) : -1, std::memory_order_relaxed);
}

}  // namespace loom::kernels
