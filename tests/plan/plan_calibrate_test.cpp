// `loom calibrate`: the GEMM-curve fit recovers a known curve, and a quick
// calibration writes a file the hardware reader accepts (positive figures, link
// figures marked as not measured) and `loom plan` plans on.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "../cli/cli_runner.h"
#include "loom/error.h"
#include "loom/plan/calibration.h"
#include "loom/plan/collective_cost.h"
#include "loom/plan/hardware.h"
#include "loom/plan/time_model.h"

using namespace loom;
using namespace loom::plan;

TEST(Calibrate, FitRecoversAKnownGemmCurve) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> gmax_d(0.5, 0.95), half_d(16, 200),
      dim(16, 4096);
  const double gmax = gmax_d(rng), half = half_d(rng), peak = 1e11;
  std::vector<RelativeSample> samples;
  for (int i = 0; i < 12; ++i) {
    GemmSample s{std::round(dim(rng)), std::round(dim(rng)),
                 std::round(dim(rng)), 0};
    s.flops_per_s = peak * gmax * s.M / (s.M + half) * s.N / (s.N + half) *
                    s.K / (s.K + half);
    samples.push_back({s, peak});
  }
  GemmCurve c = fit_gemm_curve(samples);
  EXPECT_NEAR(c.gemm_max, gmax, 0.02 * gmax);
  EXPECT_NEAR(c.gemm_half_dim, half, 0.03 * half);
  EXPECT_LT(c.rms_log_error, 0.01);
}

TEST(Calibrate, QuickRunWritesAHardwareFileThatPlansAccept) {
  namespace fs = std::filesystem;
  const fs::path file =
      fs::temp_directory_path() /
      ("loom-calibrate-" + std::to_string(::getpid()) + ".toml");
  auto r =
      test::run_loom("calibrate --quick --threads 1 --out " + file.string());
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  Hardware hw = load_hardware(file.string());
  EXPECT_GT(hw.device.peak_f32, 0);
  EXPECT_GT(hw.device.peak_bf16, 0);
  EXPECT_GT(hw.device.memory_bytes, 0);
  EXPECT_GT(hw.device.memory_bandwidth, 0);
  EXPECT_EQ(hw.devices_per_node, 1);
  EXPECT_GT(hw.efficiency.gemm_max, 0);
  EXPECT_LE(hw.efficiency.gemm_max, 1);
  // Loom's own attention and element-wise kernels were measured too.
  EXPECT_GT(hw.device.attention_flops, 0);
  EXPECT_GT(hw.efficiency.memory, 0);
  EXPECT_LE(hw.efficiency.memory, 1);
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  // The link is Loom's own collectives between two ranks of this machine.
  EXPECT_NE(text.find("Measured: Loom's collectives"), std::string::npos) << text;
  EXPECT_NE(text.find("collective_us = ["), std::string::npos);
  EXPECT_GT(hw.intra_node.bandwidth, 1e8);  // shared memory moves more than 100 MB/s
  EXPECT_GT(hw.intra_node.latency, 0);
  EXPECT_LT(hw.intra_node.latency, 1e-3);
  EXPECT_EQ(hw.efficiency.link, 1.0);
  EXPECT_NE(text.find("[calibration]"), std::string::npos);
  auto p = test::run_loom("plan --model tiny --cluster " + file.string() +
                          " --seq 64 --global-batch 4 --top 1 --json");
  EXPECT_EQ(p.rc, 0) << p.out << p.err;
  EXPECT_NE(p.out.find("tokens_per_s"), std::string::npos);
  // Without the collectives the file says where its link figures are placeholders.
  r = test::run_loom("calibrate --quick --threads 1 --no-comm --out " + file.string());
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  std::ifstream again(file);
  std::string placeholder((std::istreambuf_iterator<char>(again)), {});
  EXPECT_NE(placeholder.find("NOT MEASURED (calibrate ran with --no-comm)"), std::string::npos);
  EXPECT_NE(r.out.find("links not measured"), std::string::npos);
  fs::remove(file);
}

TEST(Calibrate, LinkFitRecoversAKnownAlphaBeta) {
  const Link truth{12e9, 2.5e-6, Topology::SharedMemory};
  std::vector<CollectiveSample> samples;
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter"})
    for (int ranks : {2, 4})
      for (double bytes = 8; bytes <= 64.0 * (1 << 20); bytes *= 16) {
        const Collective c = std::string(op) == "all_reduce"   ? Collective::AllReduce
                             : std::string(op) == "all_gather" ? Collective::AllGather
                                                               : Collective::ReduceScatter;
        samples.push_back({op, ranks, bytes, collective_time(c, bytes, ranks, truth, 1.0)});
      }
  const LinkFit f = fit_link(samples);
  // The smallest message still carries 8 bytes and the largest some latency: within a percent.
  EXPECT_NEAR(f.link.latency, truth.latency, 0.01 * truth.latency);
  EXPECT_NEAR(f.link.bandwidth, truth.bandwidth, 0.01 * truth.bandwidth);
  EXPECT_LT(f.rms_log_error, 0.01);
  EXPECT_THROW(fit_link({}), ConfigError);
}

// Loom's measured kernels become hardware figures: the median attention rate, and the element-wise
// kernels' streaming rate over the triad's as the memory efficiency; they round-trip through TOML and
// slow the planner's attention and memory-bound time exactly where measured.
TEST(Calibrate, LoomsOwnKernelsBecomeTheAttentionRateAndTheMemoryEfficiency) {
  Calibration c;
  c.device_name = "test cpu";
  c.peak_f32 = 1e11, c.peak_bf16 = 2e11, c.memory_bytes = 8.0 * (1 << 30);
  c.bf16 = {{512, 512, 512, 1.6e11}, {64, 64, 64, 4e10}};
  c.f32 = {{512, 512, 512, 8e10}};
  c.stream = {{double(1 << 30), 40e9}};
  c.attention = {{{4, 256, 6, 64}, 3e10}, {{1, 1024, 8, 64}, 5e10}, {{1, 2048, 8, 128}, 4e10}};
  c.elementwise_bytes_per_s = 30e9;
  Hardware hw = hardware_from_calibration(c);
  EXPECT_DOUBLE_EQ(hw.device.attention_flops, 4e10);
  EXPECT_DOUBLE_EQ(hw.efficiency.memory, 0.75);
  Hardware back = parse_hardware(hardware_to_toml(hw, "test", {}), "rt.toml");
  EXPECT_NEAR(back.device.attention_flops, 4e10, 1e4);

  Job j;
  j.model = plan_model("mini");
  j.cluster = {hw, 1};
  j.seq = 256, j.global_batch = 8;
  const Layout l{.micro_batch = 8};
  const StepTime measured = step_time(l, j);
  j.cluster.hw.device.attention_flops = 0;  // flash attention on the GEMM curve
  const StepTime curve = step_time(l, j);
  EXPECT_GT(measured.memory_bound, curve.memory_bound) << "attention at 40 GFLOP/s is slower than the curve";
  EXPECT_DOUBLE_EQ(measured.compute, curve.compute);
  c.attention.clear(), c.elementwise_bytes_per_s = 0;
  EXPECT_DOUBLE_EQ(hardware_from_calibration(c).efficiency.memory, 1.0) << "not measured: the triad is the rate";
}

