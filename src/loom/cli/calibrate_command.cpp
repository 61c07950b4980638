// `loom calibrate --out FILE`: measures this machine -- GEMM rates per dtype
// and size, streaming memory bandwidth, and Loom's collectives between ranks on
// it (latency and bandwidth per group size, via `loom run -n N -- loom bench
// comm --json`) -- and writes a hardware description in the format of
// configs/hardware/*.toml, so `loom plan --cluster FILE` plans for it.
#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/cli/commands.h"
#include "loom/cli/layer_gemm_timing.h"
#include "loom/core/allocator.h"
#include "loom/core/cpu_features.h"
#include "loom/core/output_folder.h"
#include "loom/error.h"
#include "loom/kernels/attention.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/elementwise.h"
#include "loom/kernels/gemm.h"
#include "loom/kernels/peak_probe.h"
#include "loom/kernels/stream_probe.h"
#include "loom/plan/calibration.h"
#include "loom/train/run_config.h"

namespace loom::cli {

namespace {

struct CalibrateOptions {
  std::string out;
  int threads = 0;
  bool quick = false;
  bool comm = true;
  std::vector<int> comm_ranks{2};
  std::vector<std::string> models;  // --model CONFIG: that model's layer GEMMs at its shapes
};

using Clock = std::chrono::steady_clock;
// Below this share of its cores, calibrate says its figures are not the machine's.
constexpr double kBusyShare = 0.8;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The share of `threads` cores this process gets: its threads spin together for ~50 ms and their CPU
// time is compared with the wall time. ~1 on an idle machine; other work on the cores (or a cgroup
// quota) lowers it, and every figure calibrate measures shrinks with it -- a tiny kernel behind an
// OpenMP barrier by orders of magnitude (seen: attention timed 5000x slow beside an 8-rank job).
double core_share(int threads) {
  std::vector<double> cpu(static_cast<size_t>(threads), 0.0);
  const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
  {
    timespec a{}, b{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    volatile double x = 1.0;
    while (seconds_since(t0) < 0.05)
      for (int i = 0; i < 1000; ++i) x = x * 1.0000001 + 1e-9;
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    cpu[static_cast<size_t>(omp_get_thread_num())] = double(b.tv_sec - a.tv_sec) + 1e-9 * double(b.tv_nsec - a.tv_nsec);
  }
  const double wall = seconds_since(t0);
  double total = 0;
  for (double c : cpu) total += c;
  return total / (wall * threads);
}

// Best rate of `run` doing `work` units: a warm-up (primitive creation, page
// faults), then repetitions until `budget` seconds have passed (at least two).
// Best, not mean: other processes share the cores.
template <class Run> double best_rate(double work, double budget, Run &&run) {
  run();
  double best = 0;
  const auto start = Clock::now();
  for (int rep = 0; rep < 2 || seconds_since(start) < budget; ++rep) {
    const auto t0 = Clock::now();
    run();
    best = std::max(best, work / seconds_since(t0));
    if (rep > 1000)
      break;
  }
  return best;
}

// Best rate of one GEMM shape (best_rate).
plan::GemmSample time_gemm(int64_t M, int64_t N, int64_t K, DType dtype,
                           double budget, Allocator &alloc) {
  GemmOperands g({.M = M, .N = N, .K = K, .ab_type = dtype}, alloc);
  return {double(M), double(N), double(K), best_rate(g.flops(), budget, [&] { g.run(alloc); })};
}

// Loom's attention kernel, forward then backward, at one shape: FLOP/s by the kernel's own declared
// costs, the median over repetitions for `budget` seconds, each call with the core caches evicted
// (AttentionOperands).
std::pair<std::vector<int64_t>, double> time_attention(int64_t B, int64_t T, int64_t H, int64_t D, bool bf16,
                                                       double budget, Allocator &alloc) {
  AttentionOperands op({.B = B, .T = T, .H = H, .KVH = H, .D = D, .scale = 1.0f / std::sqrt(float(D)), .bf16 = bf16});
  ColdCaches cold;
  std::vector<double> rates;
  const auto start = Clock::now();
  for (int rep = 0; (rep < 4 || seconds_since(start) < budget) && rep <= 1000; ++rep) {
    const double t = op.run_once(cold, alloc);
    if (rep > 0) rates.push_back(op.flops() / t);  // the first call pays for the workspace
  }
  std::nth_element(rates.begin(), rates.begin() + static_cast<std::ptrdiff_t>(rates.size() / 2), rates.end());
  return {{B, T, H, D}, rates[rates.size() / 2]};
}

// Loom's element-wise kernels as a step mixes them -- GeLU forward and backward, LayerNorm forward and
// backward, AdamW -- over arrays of `floats` (past the caches): their declared bytes over their time,
// the best of `passes`. One kernel alone is a noisy, biased figure (GeLU's arithmetic made it read
// 15-22 GB/s on a machine whose step streams at ~23).
double time_elementwise(int64_t floats, int passes) {
  const auto n = static_cast<size_t>(floats);
  const int64_t C = 1024, N = floats / C;
  std::vector<float> a(n), b(n), c(n), d(n), stats(static_cast<size_t>(2 * N)), w(C, 1.0f), wb(C), dw(C), db(C);
  std::vector<bf16> copy(n);
  for (size_t i = 0; i < n; ++i) a[i] = 0.001f * static_cast<float>(static_cast<int64_t>(i % 2001) - 1000);
  float *mean = stats.data(), *rstd = stats.data() + N;
  const double bytes = kernels::gelu_cost(floats, false).bytes + kernels::gelu_cost(floats, true).bytes +
                       kernels::layernorm_cost(N, C, false).bytes + kernels::layernorm_cost(N, C, true).bytes +
                       kernels::adamw_cost(floats).bytes;
  auto mix = [&] {
    kernels::gelu_forward(b.data(), a.data(), floats);
    kernels::gelu_backward(c.data(), a.data(), b.data(), floats);
    kernels::layernorm_forward(b.data(), mean, rstd, a.data(), w.data(), wb.data(), N, C, 1e-5f);
    kernels::layernorm_backward(d.data(), dw.data(), db.data(), c.data(), a.data(), w.data(), mean, rstd, N, C);
    kernels::adamw_update(b.data(), c.data(), d.data(), copy.data(), a.data(), floats, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f,
                          1, 1.0f);
  };
  mix();
  double best = 0;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = Clock::now();
    mix();
    best = std::max(best, bytes / seconds_since(t0));
  }
  return best;
}

// STREAM triad at one array size (kernels/stream_probe.h).
plan::StreamSample time_triad(size_t array_bytes, int passes) {
  const size_t n = array_bytes / sizeof(double);
  return {static_cast<double>(n * sizeof(double)), kernels::stream_triad_bandwidth(n * sizeof(double), passes)};
}

// `loom run -n RANKS -- loom BENCH` in a job of its own: its output (every rank's) and exit status.
std::pair<std::string, int> run_ranks(int ranks, const std::string &bench) {
  const std::string self = self_executable();
  if (self.empty())
    throw IoError("loom calibrate: cannot find its own executable to start `loom " + bench + "` on " +
                  std::to_string(ranks) + " ranks; pass --no-comm");
  const std::string cmd = fmt::format("'{0}' run -n {1} -- '{0}' {2} 2>&1", self, ranks, bench);
  FILE *p = ::popen(cmd.c_str(), "r");
  if (p == nullptr)
    throw IoError("loom calibrate: cannot start '" + cmd + "'");
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    text.append(buf, n);
  return {text, ::pclose(p)};
}

// The JSON object of each line of `text` that is one, with `key`.
std::vector<nlohmann::json> json_rows(const std::string &text, const char *key) {
  std::vector<nlohmann::json> rows;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{')
      continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains(key))
      rows.push_back(std::move(j));
  }
  return rows;
}

// --quick (seconds-long test runs) times back-to-back batches: busy work under a loaded test machine
// makes its few small-message samples measure the load.
double busy_ms(bool quick) { return quick ? 0 : 3; }

// Loom's collectives between `ranks` ranks of this machine as a training step issues them, timed by
// `loom bench comm --busy-ms` in a job of its own (one JSON row per op and size): each op alone after
// a few milliseconds of GEMMs on every rank, so a rank the machine's noise made late is waited for,
// and the GEMMs' threads share the cores with the transport's. Back-to-back batches on idle ranks (what
// `loom bench comm` reports by default) read 3-10x faster than a step's collectives on the 2-core
// development VM: tp2's 3 MB all-reduces waited 1.7-2.5 ms each in `mini`'s step against 0.25 ms
// predicted from them. `plain`: unregistered buffers, which the transport stages (staged_intra_node).
std::vector<plan::CollectiveSample> time_collectives(int ranks, bool quick, bool plain) {
  const auto [text, status] = run_ranks(
      ranks, fmt::format("bench comm --json --no-ceiling --ops all_reduce,all_gather,reduce_scatter -b 8 -e {} -f 16 "
                         "--batches {} --batch-seconds {} --busy-ms {}{}",
                         quick ? "64K" : "64M", quick ? 1 : 5, quick ? 0.01 : 0.05, busy_ms(quick),
                         plain ? " --plain" : ""));
  std::vector<plan::CollectiveSample> out;
  for (const auto &j : json_rows(text, "time_us"))
    out.push_back({j["op"].get<std::string>(), j["ranks"].get<int>(),
                   j["bytes"].get<double>(), j["time_us"].get<double>() * 1e-6});
  if (status != 0 || out.empty())
    throw IoError(fmt::format(
        "loom calibrate: the collectives benchmark on {} ranks failed (exit "
        "status {}); its output:\n{}\npass --no-comm to calibrate without it",
        ranks, status, text));
  return out;
}

// The layer GEMMs of the model in `config` as each of `ranks` ranks sharing this machine runs them, on
// its share of the cores while the others run theirs (`loom bench gemm` in a job of its own): per
// shape, the median over the ranks' rates, as MeasuredGemm::ranks = ranks entries.
// Its attention likewise (the same job's `attention_tflops` rows).
struct PerRankKernels {
  std::vector<plan::MeasuredGemm> gemms;
  std::vector<plan::MeasuredAttention> attention;
};
PerRankKernels time_model_kernels_per_rank(const std::string &config, int ranks, double budget) {
  const auto [text, status] =
      run_ranks(ranks, fmt::format("bench gemm --json --budget {} --config '{}'", budget, config));
  std::vector<plan::MeasuredGemm> samples;
  for (const auto &j : json_rows(text, "tflops"))
    samples.push_back({j["m"].get<double>(), j["n"].get<double>(), j["k"].get<double>(), j["bytes"].get<double>(),
                       j["tflops"].get<double>() * 1e12, ranks});
  std::vector<plan::MeasuredAttention> attention;
  for (const auto &j : json_rows(text, "attention_tflops"))
    attention.push_back({j["b"].get<double>(), j["t"].get<double>(), j["heads"].get<double>(),
                         j["kv_heads"].get<double>(), j["head_dim"].get<double>(), j["bytes"].get<double>(),
                         j["attention_tflops"].get<double>() * 1e12, ranks});
  if (status != 0 || samples.empty())
    throw IoError(fmt::format("loom calibrate: the per-rank GEMM benchmark of {} on {} ranks failed (exit status {}); "
                              "its output:\n{}\npass --no-comm to calibrate without it",
                              config, ranks, status, text));
  return {plan::merge_gemm_samples(samples), plan::merge_attention_samples(attention)};
}

int run_calibrate(const CalibrateOptions &o) {
  if (o.out.empty())
    throw ConfigError("loom calibrate needs --out FILE");
  check_output_file(o.out, "--out");  // before minutes of measuring, not after
  const auto start = Clock::now();
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, resolve_threads(o.threads));
  plan::Calibration cal;
  cal.threads = backend.threads();
  cal.device_name = fmt::format("{} ({} threads)",
                                CpuFeatures::detect().model_name, cal.threads);
  cal.memory_bytes =
      double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE));
  double share = core_share(cal.threads);

  // Cubes from tile-sized to large, plus thin shapes (one small dimension, as a
  // split attention head or a small micro-batch gives) so the fit sees each
  // dimension's effect. --quick keeps it to seconds.
  struct Shape {
    int64_t M, N, K;
  };
  std::vector<Shape> shapes =
      o.quick ? std::vector<Shape>{{32, 32, 32},
                                   {64, 64, 64},
                                   {128, 128, 128},
                                   {64, 128, 128}}
              : std::vector<Shape>{
                    {64, 64, 64},     {128, 128, 128},    {256, 256, 256},
                    {512, 512, 512},  {1024, 1024, 1024}, {2048, 2048, 2048},
                    {64, 2048, 2048}, {2048, 64, 2048},   {2048, 2048, 64}};
  const double budget = o.quick ? 0.01 : 0.3;
  for (DType t : {DType::F32, DType::BF16}) {
    auto &samples = t == DType::F32 ? cal.f32 : cal.bf16;
    for (auto s : shapes)
      samples.push_back(time_gemm(s.M, s.N, s.K, t, budget, alloc));
    double peak = 0;
    if (o.quick) {
      for (auto &s : samples)
        peak = std::max(peak, s.flops_per_s);
      cal.peak_source = "best quick sample";
    } else {
      // The same cached probe `loom train` divides by for MFU, so plans and
      // runs share one denominator.
      auto p = kernels::device_peak_flops(t, cal.threads);
      peak = p.flops_per_s;
      cal.peak_source = p.source;
    }
    (t == DType::F32 ? cal.peak_f32 : cal.peak_bf16) = peak;
  }
  // Arrays past the reported L3 (480 MiB on the development machine, DESIGN.md)
  // so the largest triad streams from DRAM; the smaller sizes show the cache
  // levels.
  const std::vector<size_t> arrays =
      o.quick ? std::vector<size_t>{1 << 20, 4 << 20}
              : std::vector<size_t>{16 << 20, 64 << 20, 256 << 20, 512 << 20};
  for (size_t bytes : arrays)
    cal.stream.push_back(time_triad(bytes, o.quick ? 2 : 4));
  // Loom's own non-GEMM kernels: attention at a `mini`-like and a longer shape, GeLU past the caches.
  // Both precisions' kernels (bf16 training runs bf16 dot products where the CPU has them).
  for (bool bf16 : {false, true}) {
    auto &into = bf16 ? cal.attention_bf16 : cal.attention;
    if (o.quick) {
      into.push_back(time_attention(1, 64, 2, 32, bf16, budget, alloc));
    } else {
      into.push_back(time_attention(4, 256, 6, 64, bf16, budget, alloc));
      into.push_back(time_attention(1, 1024, 8, 64, bf16, budget, alloc));
      into.push_back(time_attention(1, 2048, 8, 128, bf16, budget, alloc));
    }
  }
  // The models' layer kernels on the whole machine, timed in two halves: one now and one after the
  // links and the per-rank kernels (20-40 s later), each shape's rounds pooled into one median. A slow
  // phase of the development VM had covered a whole 6-second window once and put every layer GEMM of
  // `mini` 26% slow (BENCHMARKS.md, the local loop); pooled over two windows, one phase moves at most
  // half the rounds.
  struct ModelKernels {
    std::vector<LayerGemm> gemms;
    std::vector<LayerAttention> attention;
  };
  std::vector<ModelKernels> model_kernels;
  const double half_budget = (o.quick ? 0.01 : 0.2) / 2;
  for (const auto &config : o.models) {
    model_kernels.push_back({model_layer_gemms(config), model_layer_attention(config)});
    time_layer_gemms(model_kernels.back().gemms, half_budget, alloc);
    time_layer_attention(model_kernels.back().attention, half_budget, alloc);
  }
  cal.elementwise_bytes_per_s = time_elementwise(o.quick ? (1 << 20) : (16 << 20), o.quick ? 2 : 4);

  if (o.comm)
    for (int ranks : o.comm_ranks) {
      if (ranks < 2)
        throw ConfigError(fmt::format(
            "--comm-ranks {}: a collective needs at least 2 ranks", ranks));
      cal.collective_busy_ms = busy_ms(o.quick);
      auto samples = time_collectives(ranks, o.quick, false);
      cal.collectives.insert(cal.collectives.end(), samples.begin(),
                             samples.end());
      auto staged = time_collectives(ranks, o.quick, true);
      cal.collectives_staged.insert(cal.collectives_staged.end(), staged.begin(), staged.end());
      // The same ranks' GEMMs: a rank on its share of the cores is not the whole machine shared out.
      for (const auto &config : o.models) {
        auto per_rank = time_model_kernels_per_rank(config, ranks, o.quick ? 0.01 : 0.2);
        cal.engine_gemms.insert(cal.engine_gemms.end(), per_rank.gemms.begin(), per_rank.gemms.end());
        cal.engine_attention.insert(cal.engine_attention.end(), per_rank.attention.begin(), per_rank.attention.end());
      }
    }

  for (auto &k : model_kernels) {
    auto gemms = time_layer_gemms(k.gemms, half_budget, alloc);
    cal.engine_gemms.insert(cal.engine_gemms.end(), gemms.begin(), gemms.end());
    auto attention = time_layer_attention(k.attention, half_budget, alloc);
    cal.engine_attention.insert(cal.engine_attention.end(), attention.begin(), attention.end());
  }

  // Checked before and after, since other work may start or stop meanwhile.
  share = std::min(share, core_share(cal.threads));
  if (share < kBusyShare)
    fmt::print(stderr,
               "loom calibrate: warning: this process got {:.0f}% of its {} cores (other work on the machine, or a "
               "CPU quota): every figure in {} is what was left of them; run calibrate on an idle machine\n",
               100 * share, cal.threads, o.out);
  const std::string text = plan::calibration_to_toml(cal);
  {
    std::ofstream out(o.out);
    if (!(out << text))
      throw ConfigError("cannot write '" + o.out + "'");
  }
  const plan::Hardware hw = plan::load_hardware(
      o.out); // the file must read back as a hardware description
  const std::string links =
      cal.collectives.empty()
          ? std::string("links not measured")
          : fmt::format("link {:.2f} GB/s, {:.2f} us", hw.intra_node.bandwidth * 1e-9,
                        hw.intra_node.latency * 1e6);
  fmt::print("{}: peak f32 {:.1f} / bf16 {:.1f} GFLOP/s, memory {:.1f} GB/s, "
             "gemm_max {:.3f}, gemm_half_dim {:.3g}, {} ({:.1f} s)\n",
             o.out, hw.device.peak_f32 * 1e-9, hw.device.peak_bf16 * 1e-9,
             hw.device.memory_bandwidth * 1e-9, hw.efficiency.gemm_max,
             hw.efficiency.gemm_half_dim, links, seconds_since(start));
  return 0;
}

} // namespace


void register_calibrate(CLI::App &app, Action &action) {
  auto *cmd = app.add_subcommand(
      "calibrate",
      "Measure this machine into a hardware description for `loom plan`");
  auto o = std::make_shared<CalibrateOptions>();
  cmd->add_option("--out", o->out, "hardware TOML to write")->required();
  cmd->add_option("--threads", o->threads,
                  "compute threads (default: LOOM_THREADS or all cores)")
      ->check(finite_range(0, 4096));
  cmd->add_flag("--quick", o->quick,
                "small sizes only (seconds; for tests, not for planning)");
  cmd->add_flag("!--no-comm", o->comm,
                "skip the collectives (the link figures become placeholders)");
  cmd->add_option("--model", o->models,
                  "a training config (TOML) whose layer GEMMs are timed at the shapes its layouts run; the "
                  "planner then uses those rates for them (repeatable)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--comm-ranks", o->comm_ranks,
                  "group sizes to time Loom's collectives at (default 2)")
      ->delimiter(',');
  cmd->callback([&action, o] { action = [o] { return run_calibrate(*o); }; });
}

} // namespace loom::cli
