// `loom info`: what this machine offers Loom -- CPU features, the GEMM implementations oneDNN picks,
// and the measured device peak used for MFU.
#include <fmt/format.h>

#include "loom/cli/commands.h"
#include "loom/core/allocator.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/peak_probe.h"

namespace loom::cli {

void register_info(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("info", "Show the CPU, the kernels Loom will use and the measured peak FLOP/s");
  auto threads = std::make_shared<int>(0);
  auto remeasure = std::make_shared<bool>(false);
  cmd->add_option("--threads", *threads, "compute threads (default: LOOM_THREADS or all cores)")->check(finite_range(0, 4096));
  cmd->add_flag("--remeasure", *remeasure, "measure the peak again instead of using the cached value (run on an idle machine)");
  cmd->callback([&action, threads, remeasure] {
    action = [threads, remeasure] {
      Allocator alloc;
      kernels::CpuBackend backend(alloc, nullptr, resolve_threads(*threads));
      fmt::print("{}\n", backend.describe());
      for (DType t : {DType::F32, DType::BF16}) {
        if (*remeasure) kernels::forget_cached_peak(t, backend.threads());
        auto peak = kernels::device_peak_flops(t, backend.threads());
        fmt::print("peak {} GEMM: {:.1f} GFLOP/s ({})\n", dtype_name(t), peak.flops_per_s * 1e-9, peak.source);
      }
      return 0;
    };
  });
}

}  // namespace loom::cli
