#include "loom/plan/calibration.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "loom/error.h"
#include "loom/plan/collective_cost.h"

namespace loom::plan {

GemmCurve fit_gemm_curve(std::span<const RelativeSample> samples) {
  GemmCurve best;
  if (samples.empty())
    return best;
  // For a fixed half_dim the best log(gemm_max) is the mean residual (capped at
  // 0: gemm_max <= 1), so a 1-D scan over half_dim (log-spaced, 0.5 .. 8192)
  // finds the least-squares pair.
  double best_sse = INFINITY;
  for (double h = 0.5; h <= 8192; h *= 1.02) {
    auto residual = [&](const RelativeSample &r) {
      const double fill = std::log(r.s.M / (r.s.M + h)) +
                          std::log(r.s.N / (r.s.N + h)) +
                          std::log(r.s.K / (r.s.K + h));
      return std::log(r.s.flops_per_s / r.peak) - fill;
    };
    double mean = 0;
    for (auto &r : samples)
      mean += residual(r) / samples.size();
    mean = std::min(mean, 0.0);
    double sse = 0;
    for (auto &r : samples)
      sse += std::pow(residual(r) - mean, 2);
    if (sse < best_sse)
      best_sse = sse,
      best = {std::exp(mean), h, std::sqrt(sse / samples.size())};
  }
  return best;
}

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
} // namespace

namespace {
// One entry per key (`same`), at the median of its samples' rates.
template <class Sample, class Same>
std::vector<Sample> merge_by_median(std::span<const Sample> samples, Same same) {
  std::vector<Sample> out;
  std::vector<std::vector<double>> rates;
  for (const Sample &g : samples) {
    size_t i = 0;
    while (i < out.size() && !same(out[i], g))
      ++i;
    if (i == out.size()) out.push_back(g), rates.emplace_back();
    rates[i].push_back(g.flops_per_s);
  }
  for (size_t i = 0; i < out.size(); ++i) {
    auto &r = rates[i];
    std::sort(r.begin(), r.end());
    const size_t n = r.size();
    out[i].flops_per_s = n % 2 ? r[n / 2] : (r[n / 2 - 1] + r[n / 2]) / 2;
  }
  return out;
}
}  // namespace

std::vector<MeasuredGemm> merge_gemm_samples(std::span<const MeasuredGemm> samples) {
  return merge_by_median(samples, [](const MeasuredGemm &a, const MeasuredGemm &b) {
    return a.M == b.M && a.N == b.N && a.K == b.K && a.bytes == b.bytes && a.ranks == b.ranks;
  });
}

std::vector<MeasuredAttention> merge_attention_samples(std::span<const MeasuredAttention> samples) {
  return merge_by_median(samples, [](const MeasuredAttention &a, const MeasuredAttention &b) {
    return a.B == b.B && a.T == b.T && a.heads == b.heads && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
           a.bytes == b.bytes && a.ranks == b.ranks;
  });
}

Hardware hardware_from_calibration(const Calibration &c) {
  if (c.peak_bf16 <= 0 || c.bf16.empty())
    throw ConfigError("calibration has no bf16 GEMM rate");
  if (c.stream.empty())
    throw ConfigError("calibration has no memory-bandwidth measurement");
  Hardware hw;
  hw.name = "calibrated";
  hw.source = fmt::format("loom calibrate, {} threads", c.threads);
  hw.device.name = c.device_name;
  hw.device.peak_f32 = c.peak_f32;
  hw.device.peak_bf16 = c.peak_bf16;
  hw.device.memory_bytes = c.memory_bytes;
  // The largest working set: the only one sure to stream from DRAM (a large L3
  // holds the smaller ones).
  auto largest =
      std::max_element(c.stream.begin(), c.stream.end(), [](auto &a, auto &b) {
        return a.array_bytes < b.array_bytes;
      });
  hw.device.memory_bandwidth = largest->bytes_per_s;
  hw.devices_per_node =
      1; // the CPU is one device; ranks on it share its cores and memory
  if (!c.collectives.empty()) {
    // Measured between ranks on this machine (shared memory). There is no network to another machine
    // to measure: inter_node copies it.
    hw.intra_node = fit_link(c.collectives).link;
    if (!c.collectives_staged.empty()) hw.staged_intra_node = fit_link(c.collectives_staged).link;
    hw.efficiency.link = 1.0; // the bandwidth is the achieved bus bandwidth
  } else {
    // Not measured: a shared-memory copy reads and writes each byte, so half the streaming bandwidth
    // is the most a same-node transfer could reach; the latency is a guess.
    hw.intra_node = {hw.device.memory_bandwidth / 2, 1e-6, Topology::SharedMemory};
  }
  hw.inter_node = hw.intra_node;
  std::vector<RelativeSample> rel;
  for (auto &s : c.f32)
    rel.push_back({s, c.peak_f32});
  for (auto &s : c.bf16)
    rel.push_back({s, c.peak_bf16});
  std::erase_if(rel,
                [](auto &r) { return r.peak <= 0 || r.s.flops_per_s <= 0; });
  const GemmCurve curve = fit_gemm_curve(rel);
  hw.efficiency.gemm_max = curve.gemm_max;
  hw.efficiency.gemm_half_dim = curve.gemm_half_dim;
  hw.gemm_table = merge_gemm_samples(c.engine_gemms);
  hw.attention_table = merge_attention_samples(c.engine_attention);
  hw.efficiency.memory =
      1.0; // memory_bandwidth is already the measured streaming rate
  // What Loom's own kernels reach: its element-wise kernels stream below the triad's rate, and its
  // attention runs well below the GEMM curve.
  if (c.elementwise_bytes_per_s > 0)
    hw.efficiency.memory = std::min(1.0, c.elementwise_bytes_per_s / hw.device.memory_bandwidth);
  // The median over the measured shapes (0: not measured).
  auto median_rate = [](const std::vector<std::pair<std::vector<int64_t>, double>> &samples) {
    std::vector<double> rates;
    for (const auto &[shape, rate] : samples)
      rates.push_back(rate);
    return median(rates);
  };
  hw.device.attention_flops = median_rate(c.attention);
  hw.device.attention_bf16_flops = median_rate(c.attention_bf16);
  return hw;
}

namespace {
Collective collective_of(const std::string &op) {
  if (op == "all_reduce")
    return Collective::AllReduce;
  if (op == "all_gather")
    return Collective::AllGather;
  if (op == "reduce_scatter")
    return Collective::ReduceScatter;
  throw ConfigError("calibration: collective '" + op +
                    "' is not all_reduce, all_gather or reduce_scatter");
}

} // namespace

LinkFit fit_link(std::span<const CollectiveSample> samples) {
  if (samples.empty())
    throw ConfigError("calibration: no collective samples to fit a link to");
  // Per (op, ranks) series: alpha from its smallest message, beta from its largest.
  std::map<std::pair<std::string, int>, std::vector<CollectiveSample>> series;
  for (const auto &s : samples)
    if (s.seconds > 0 && s.bytes > 0)
      series[{s.op, s.ranks}].push_back(s);
  std::vector<double> alphas, betas;
  for (auto &[key, v] : series) {
    std::sort(v.begin(), v.end(),
              [](auto &a, auto &b) { return a.bytes < b.bytes; });
    const Collective op = collective_of(key.first);
    const double steps = latency_steps(op, key.second, Topology::SharedMemory);
    // The median of the messages up to 4 KiB (whose bytes cost nothing on any link calibrate measures),
    // not the smallest alone: timed as a step issues them, a small op's time is the ranks' skew, and
    // one sample of it moved the fitted latency between 30 and 390 us from run to run.
    std::vector<double> small;
    for (const auto &s : v)
      if (s.bytes <= 4096) small.push_back(s.seconds);
    alphas.push_back((small.empty() ? v.front().seconds : median(small)) / steps);
    const auto &big = v.back();
    betas.push_back(big.bytes * busbw_factor(op, key.second) / big.seconds);
  }
  LinkFit f;
  f.link = {median(betas), median(alphas), Topology::SharedMemory};
  double sq = 0;
  int n = 0;
  for (const auto &s : samples) {
    if (s.seconds <= 0 || s.bytes <= 0)
      continue;
    const double predicted =
        collective_time(collective_of(s.op), s.bytes, s.ranks, f.link, 1.0);
    const double e = std::log(predicted / s.seconds);
    sq += e * e;
    ++n;
  }
  f.rms_log_error = n ? std::sqrt(sq / n) : 0;
  return f;
}

std::string calibration_to_toml(const Calibration &c) {
  const Hardware hw = hardware_from_calibration(c);
  std::vector<RelativeSample> rel;
  for (auto &s : c.f32)
    rel.push_back({s, c.peak_f32});
  for (auto &s : c.bf16)
    rel.push_back({s, c.peak_bf16});
  const GemmCurve curve = fit_gemm_curve(rel);
  const std::string header =
      fmt::format("Measured by `loom calibrate` on {}. Peaks: {} (Loom's MFU "
                  "denominator).\n"
                  "GEMM efficiency curve fitted to the [calibration] samples "
                  "below (rms log error {:.3f}).\n"
                  "Memory bandwidth: STREAM triad over the largest arrays "
                  "measured (see [calibration]).",
                  c.device_name, c.peak_source, curve.rms_log_error);
  std::string not_measured =
      "NOT MEASURED (calibrate ran with --no-comm). Placeholder: half the "
      "streaming bandwidth\n"
      "(a shared-memory copy reads and writes each byte), 1 us latency. Do not "
      "trust plans that communicate.";
  if (!c.collectives.empty()) {
    const LinkFit link = fit_link(c.collectives);
    not_measured = fmt::format(
        "Measured: Loom's collectives between ranks on this machine ({}), on registered buffers\n"
        "(data parallelism's gradients); staged_intra_node: the same on plain buffers, which the transport\n"
        "stages (the activations of TP, CP, EP and pipeline transfers). Fitted to the alpha-beta model of\n"
        "collective_cost.h (shared_memory: one step per phase): latency from the messages up to 4 KiB (median),\n"
        "bandwidth = bus bandwidth of the largest (rms log error {:.3f} over every sample in [calibration]).",
        c.collective_busy_ms > 0
            ? fmt::format("as a step issues them: `loom bench comm --busy-ms {:g}`, each op alone after {:g} ms of\n"
                          "GEMMs on every rank, so a late peer is waited for",
                          c.collective_busy_ms, c.collective_busy_ms)
            : std::string("`loom bench comm`: back-to-back batches on idle ranks"),
        link.rms_log_error);
  }
  std::string out = hardware_to_toml(
      hw, header,
      {{"device", "memory_GiB: physical memory of the machine. peak_tflops: "
                  "the GEMM peak named in the header (fp8: none).\n"
                  "attention_tflops: Loom's attention kernel, forward + backward (median "
                  "of the shapes in [calibration]); attention_bf16_tflops: its bf16 kernels\n"
                  "(what bf16 training runs; the f32 ones where this CPU has no bf16 dot products)."},
       {"node", "This CPU is one device."},
       {"intra_node", not_measured},
       {"staged_intra_node", "Loom's collectives on plain buffers (see intra_node), fitted the same way."},
       {"inter_node", "NOT MEASURED: no network between machines is known; "
                      "copies intra_node."},
       {"efficiency",
        "gemm_max, gemm_half_dim: fitted (see header). memory: Loom's element-wise "
        "kernels' streaming rate\n"
        "over the triad's (1 when not measured). link: 1 when intra_node was measured "
        "(its bandwidth is achieved bus\nbandwidth), else the default of hardware.h."},
       {"gemm_table", "`loom calibrate --model`: each layer GEMM of the named models at the shapes their layouts run\n"
                      "(rows = tokens per micro-batch, columns split by tp), forward + dX + dW timed; the planner\n"
                      "uses these rates in place of the curve for exactly these shapes. Entries with ranks = R are\n"
                      "one rank's rate while R ranks share the machine (loom run -n R -- loom bench gemm), which the\n"
                      "planner uses for R-rank runs on it."},
       {"attention_table", "`loom calibrate --model`: Loom's attention kernel (forward + backward) at the named models'\n"
                           "shapes (b sequences of t tokens, heads and kv_heads of head_dim on a rank, bytes 2 for\n"
                           "its bf16 kernels); the planner uses these rates for exactly these shapes (the nearest b)\n"
                           "and attention_tflops for others. ranks = R as in gemm_table."}});
  auto list = [](auto const &v, auto f) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i)
      s += (i ? ", " : "") + f(v[i]);
    return s + "]";
  };
  auto shapes = [&](const std::vector<GemmSample> &v) {
    return list(v, [](const GemmSample &s) {
      return fmt::format("[{}, {}, {}]", s.M, s.N, s.K);
    });
  };
  auto rates = [&](const std::vector<GemmSample> &v) {
    return list(v, [](const GemmSample &s) {
      return fmt::format("{:.4g}", s.flops_per_s * 1e-9);
    });
  };
  out += "\n# Raw measurements (not read by the planner). GEMM shapes are [M, "
         "N, K]; rates in GFLOP/s, best of the\n"
         "# timed repetitions. Stream: triad a = b + s*c over three arrays of "
         "array_MiB each, GB/s counting 3 arrays.\n";
  out += fmt::format("[calibration]\nthreads = {}\n", c.threads);
  out += fmt::format("gemm_f32_shapes = {}\ngemm_f32_GFLOPs = {}\n",
                     shapes(c.f32), rates(c.f32));
  out += fmt::format("gemm_bf16_shapes = {}\ngemm_bf16_GFLOPs = {}\n",
                     shapes(c.bf16), rates(c.bf16));
  out += fmt::format("stream_array_MiB = {}\n",
                     list(c.stream, [](const StreamSample &s) {
                       return fmt::format("{:.4g}", s.array_bytes / (1 << 20));
                     }));
  out += fmt::format("stream_GBps = {}\n",
                     list(c.stream, [](const StreamSample &s) {
                       return fmt::format("{:.4g}", s.bytes_per_s * 1e-9);
                     }));
  out +=
      fmt::format("gemm_curve_rms_log_error = {:.4g}\n", curve.rms_log_error);
  if (!c.attention.empty()) {
    out += "# Loom's attention kernel, forward + backward: shapes [B, T, H, D], GFLOP/s (its declared FLOPs).\n";
    out += fmt::format("attention_shapes = {}\n", list(c.attention, [](const auto &a) {
                         return fmt::format("[{}, {}, {}, {}]", a.first[0], a.first[1], a.first[2], a.first[3]);
                       }));
    out += fmt::format("attention_GFLOPs = {}\n",
                       list(c.attention, [](const auto &a) { return fmt::format("{:.4g}", a.second * 1e-9); }));
  }
  if (!c.attention_bf16.empty())
    out += fmt::format("attention_bf16_GFLOPs = {}\n",
                       list(c.attention_bf16, [](const auto &a) { return fmt::format("{:.4g}", a.second * 1e-9); }));
  if (c.elementwise_bytes_per_s > 0)
    out += fmt::format("# Loom's element-wise kernels as a step mixes them (GeLU and LayerNorm forward and backward, AdamW) "
                       "over 64 MiB arrays: their declared bytes per second.\nelementwise_GBps = {:.4g}\n",
                       c.elementwise_bytes_per_s * 1e-9);
  auto collective_rows = [&](const std::vector<CollectiveSample> &v, const std::string &prefix,
                             const std::string &what) {
    if (v.empty()) return;
    out += fmt::format("# {}: op, ranks, bytes (nccl-tests' size), median microseconds per op.\n", what);
    out += fmt::format("{}ops = {}\n", prefix,
                       list(v, [](const CollectiveSample &s) { return fmt::format("\"{}\"", s.op); }));
    out += fmt::format("{}ranks = {}\n", prefix,
                       list(v, [](const CollectiveSample &s) { return std::to_string(s.ranks); }));
    out += fmt::format("{}bytes = {}\n", prefix,
                       list(v, [](const CollectiveSample &s) { return fmt::format("{:.0f}", s.bytes); }));
    out += fmt::format("{}us = {}\n", prefix,
                       list(v, [](const CollectiveSample &s) { return fmt::format("{:.4g}", s.seconds * 1e6); }));
  };
  collective_rows(c.collectives, "collective_", "Collectives");
  collective_rows(c.collectives_staged, "staged_collective_", "Collectives on plain (staged) buffers");
  return out;
}

} // namespace loom::plan
