// What `loom calibrate` measured on this machine, and how it becomes a hardware
// description: the size-dependent GEMM efficiency curve fitted to the measured
// rates, the raw measurements kept beside it.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "loom/plan/hardware.h"

namespace loom::plan {

// One measured GEMM: C[M,N] = A[M,K] B[K,N] at `flops_per_s` (best of its timed
// repetitions).
struct GemmSample {
  double M = 0, N = 0, K = 0;
  double flops_per_s = 0;
};

// A measured streaming rate: `bytes_per_s` over arrays of `array_bytes` each
// (STREAM triad counting: 3 arrays' bytes per pass, write-allocate traffic not
// counted).
struct StreamSample {
  double array_bytes = 0;
  double bytes_per_s = 0;
};

// One measured collective (`loom bench comm --json` between ranks on this machine): `bytes` as
// nccl-tests counts them (the all_gather output, otherwise the input), median seconds per op.
struct CollectiveSample {
  std::string op;  // all_reduce | all_gather | reduce_scatter
  int ranks = 2;
  double bytes = 0, seconds = 0;
};

struct Calibration {
  std::string device_name;
  int threads = 1;
  double memory_bytes =
      0; // what the device may use (physical memory for a CPU)
  double peak_f32 = 0,
         peak_bf16 =
             0; // FLOP/s the curve is relative to (Loom's MFU denominator)
  std::string
      peak_source; // where the peaks came from ("measured", "cache ...", ...)
  std::vector<GemmSample> f32, bf16;
  std::vector<StreamSample>
      stream; // the largest array size gives the reported bandwidth
  std::vector<CollectiveSample> collectives; // empty: links not measured
  double collective_busy_ms = 0;  // GEMM milliseconds before each timed op (`loom bench comm --busy-ms`)
  // The same ops on plain (unregistered) buffers, which the transport stages: staged_intra_node.
  std::vector<CollectiveSample> collectives_staged;
  // Loom's own kernels where they are not GEMMs: attention (forward + backward FLOP/s at each shape,
  // [B, T, H, D]) and its streaming element-wise kernels as a step mixes them (declared bytes per second).
  std::vector<std::pair<std::vector<int64_t>, double>> attention;
  std::vector<std::pair<std::vector<int64_t>, double>> attention_bf16;  // its bf16 kernels, same shapes
  double elementwise_bytes_per_s = 0;
  // `loom calibrate --model CONFIG`: that model's layer GEMMs at the shapes its layouts run (hardware.h).
  std::vector<MeasuredGemm> engine_gemms;
  // And its attention at those layouts' shapes (hardware.h's attention_table).
  std::vector<MeasuredAttention> engine_attention;
};

// The intra-node link that explains the collective samples with collective_cost.h's alpha-beta model
// (shared-memory topology: Loom's one-shot / direct algorithms, one step per phase; efficiency 1): latency from the smallest messages, bandwidth from the largest
// (the median over ops and group sizes of each), and the fit's rms log error over every sample.
struct LinkFit {
  Link link;
  double rms_log_error = 0;
};
// Throws ConfigError when there is no sample to fit.
LinkFit fit_link(std::span<const CollectiveSample> samples);

// The curve of time_model.h, rate = peak * gemm_max * prod_d d / (d +
// gemm_half_dim), fitted by least squares on log(rate / peak) over all samples;
// gemm_max is capped at 1 (peak is a measured rate).
struct GemmCurve {
  double gemm_max = 1, gemm_half_dim = 0;
  double rms_log_error =
      0; // of the fit, in natural-log units (0.05 ~ 5% typical miss)
};
struct RelativeSample {
  GemmSample s;
  double peak = 0;
};
GemmCurve fit_gemm_curve(std::span<const RelativeSample> samples);

// One rate per GEMM shape (M, N, K, bytes): the median of the samples of that shape, in the order
// shapes first appear. `loom calibrate --model` times a shape once per model and tp that gives it (two
// models sharing their attention, rows that coincide), and on a noisy machine two samples of one
// shape differ by up to 1.5x (BENCHMARKS.md): the planner would otherwise take whichever came first.
std::vector<MeasuredGemm> merge_gemm_samples(std::span<const MeasuredGemm> samples);
// The same for attention samples (one entry per shape, element size and ranks).
std::vector<MeasuredAttention> merge_attention_samples(std::span<const MeasuredAttention> samples);

// The hardware description of one calibrated device: measured peaks, memory and
// bandwidth, the fitted curve, and the link fitted to the collective samples
// (placeholders when there are none). Throws ConfigError when a figure the
// format needs is missing (no bf16 rate, no stream sample).
Hardware hardware_from_calibration(const Calibration &c);

// The whole file `loom calibrate` writes: the hardware description
// (parse_hardware reads it back) with comments marking what was not measured,
// then a [calibration] table of the raw measurements, which the planner
// ignores.
std::string calibration_to_toml(const Calibration &c);

} // namespace loom::plan
