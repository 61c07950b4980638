// `loom bench gemm --config CONFIG`: a model's layer GEMMs (forward and both backward GEMMs at the shapes
// its layouts run; cli/layer_gemm_timing.h) and its attention kernel at those layouts' shapes, timed with
// this process's threads. Run one copy per rank
// (`loom run -n 2 -- loom bench gemm --config configs/mini.toml`) to see what a rank of a job that
// shares the machine gets while the others run theirs: `loom calibrate --model` does that, and the
// planner prices those ranks' GEMMs at those rates.
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>

#include "loom/cli/commands.h"
#include "loom/cli/layer_gemm_timing.h"
#include "loom/kernels/cpu_backend.h"

namespace loom::cli {

namespace {

struct BenchGemmArgs {
  std::string config;
  double budget = 0.2;
  bool json = false;
};

int bench_gemm(const BenchGemmArgs& a) {
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, resolve_threads(0));
  const char* rank_env = std::getenv("LOOM_RANK");
  const int rank = rank_env ? std::atoi(rank_env) : 0;
  auto shapes = model_layer_gemms(a.config);
  const auto rates = time_layer_gemms(shapes, a.budget, alloc);
  if (!a.json)
    fmt::print("# loom bench gemm: {} layer GEMMs of {}, rank {}, {} threads; forward + dX + dW, cold caches, "
               "median of the rounds\n{:>7} {:>7} {:>7} {:>6} {:>9}\n",
               rates.size(), a.config, rank, backend.threads(), "M", "N", "K", "bytes", "GFLOP/s");
  for (const auto& g : rates) {
    if (a.json)
      fmt::print("{}\n", nlohmann::json{{"rank", rank},   {"threads", backend.threads()}, {"m", g.M},
                                        {"n", g.N},       {"k", g.K},                     {"bytes", g.bytes},
                                        {"tflops", g.flops_per_s * 1e-12}}
                             .dump());
    else
      fmt::print("{:>7.0f} {:>7.0f} {:>7.0f} {:>6.0f} {:>9.1f}\n", g.M, g.N, g.K, g.bytes, g.flops_per_s * 1e-9);
  }
  auto attention_shapes = model_layer_attention(a.config);
  const auto attention = time_layer_attention(attention_shapes, a.budget, alloc);
  if (!a.json)
    fmt::print("# its attention (forward + backward), cold caches, median of the rounds\n{:>4} {:>6} {:>5} {:>8} {:>8} "
               "{:>5} {:>9}\n",
               "B", "T", "heads", "kv_heads", "head_dim", "bytes", "GFLOP/s");
  for (const auto& x : attention) {
    if (a.json)
      fmt::print("{}\n", nlohmann::json{{"rank", rank},         {"threads", backend.threads()}, {"b", x.B},
                                        {"t", x.T},               {"heads", x.heads},             {"kv_heads", x.kv_heads},
                                        {"head_dim", x.head_dim}, {"bytes", x.bytes},
                                        {"attention_tflops", x.flops_per_s * 1e-12}}
                             .dump());
    else
      fmt::print("{:>4.0f} {:>6.0f} {:>5.0f} {:>8.0f} {:>8.0f} {:>5.0f} {:>9.1f}\n", x.B, x.T, x.heads, x.kv_heads,
                 x.head_dim, x.bytes, x.flops_per_s * 1e-9);
  }
  return 0;
}

}  // namespace

void register_bench_gemm(CLI::App& bench, Action& action) {
  auto* cmd = bench.add_subcommand(
      "gemm", "A model's layer GEMMs and attention as a step runs them, with this process's threads; run one copy per rank: "
              "loom run -n 2 -- loom bench gemm --config configs/mini.toml");
  auto a = std::make_shared<BenchGemmArgs>();
  cmd->add_option("-c,--config", a->config, "the model's config (as for loom train)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--budget", a->budget, "seconds per shape, spread over rounds of every shape (default 0.2)")
      ->check(finite_range(0.001, 60));
  cmd->add_flag("--json", a->json, "one JSON object per shape (rank, threads, m, n, k, bytes, tflops)");
  cmd->callback([&action, a] { action = [a] { return bench_gemm(*a); }; });
}

}  // namespace loom::cli
