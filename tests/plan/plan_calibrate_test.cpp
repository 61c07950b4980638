// `loom calibrate`: the GEMM-curve fit recovers a known curve, and a quick
// calibration writes a file the hardware reader accepts (positive figures, link
// figures marked as not measured) and `loom plan` plans on.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "../cli/cli_runner.h"
#include "loom/plan/calibration.h"
#include "loom/plan/hardware.h"

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
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("NOT MEASURED"), std::string::npos);
  EXPECT_NE(text.find("[calibration]"), std::string::npos);
  auto p = test::run_loom("plan --model tiny --cluster " + file.string() +
                          " --seq 64 --global-batch 4 --top 1 --json");
  EXPECT_EQ(p.rc, 0) << p.out << p.err;
  EXPECT_NE(p.out.find("tokens_per_s"), std::string::npos);
  fs::remove(file);
}
