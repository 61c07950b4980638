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

// Samples of one shape become one rate, their median, in the order shapes first appear.
TEST(Calibration, OneShapeTimedSeveralTimesKeepsTheMedianRate) {
  const MeasuredGemm samples[] = {{512, 1024, 384, 2, 1.2e11}, {64, 64, 64, 4, 1e10}, {512, 1024, 384, 2, 1.5e11},
                                  {512, 1024, 384, 2, 1.3e11}, {512, 1024, 384, 4, 9e10}, {64, 64, 64, 4, 2e10}};
  const auto merged = merge_gemm_samples(samples);
  ASSERT_EQ(merged.size(), 3u);
  EXPECT_DOUBLE_EQ(merged[0].flops_per_s, 1.3e11);  // 1.2, 1.3, 1.5
  EXPECT_EQ(merged[1].M, 64);
  EXPECT_DOUBLE_EQ(merged[1].flops_per_s, 1.5e10);  // the mean of the middle two
  EXPECT_EQ(merged[2].bytes, 4);
  EXPECT_DOUBLE_EQ(merged[2].flops_per_s, 9e10);
}

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
  EXPECT_GT(hw.device.attention_bf16_flops, 0) << "the bf16 kernels (the f32 ones without bf16 dot products)";
  EXPECT_GT(hw.efficiency.memory, 0);
  EXPECT_LE(hw.efficiency.memory, 1);
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  // The link is Loom's own collectives between two ranks of this machine.
  EXPECT_NE(text.find("Measured: Loom's collectives"), std::string::npos) << text;
  EXPECT_NE(text.find("collective_us = ["), std::string::npos);
  // Plausibility only: ctest runs this beside other tests on a 2-core machine, where the two ranks
  // share the cores with them (shared memory measured 91 MB/s with four such runs at once).
  EXPECT_GT(hw.intra_node.bandwidth, 1e7);
  EXPECT_GT(hw.intra_node.latency, 0);
  EXPECT_LT(hw.intra_node.latency, 1e-2);
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

// On cores other work keeps busy, every figure calibrate measures is what is left of them: it says
// so (one busy loop per core beside it here), and still writes the file.
TEST(Calibrate, SaysWhenItDidNotHaveTheCoresToItself) {
  namespace fs = std::filesystem;
  const fs::path file = fs::temp_directory_path() / ("loom-calibrate-busy-" + std::to_string(::getpid()) + ".toml");
  auto r = test::run_shell("pids=; for i in $(seq $(nproc)); do yes >/dev/null & pids=\"$pids $!\"; done; " +
                           std::string(LOOM_BINARY) + " calibrate --quick --threads 1 --no-comm --out " +
                           file.string() + "; rc=$?; kill $pids; exit $rc");
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("warning: this process got"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("run calibrate on an idle machine"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(file));
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

// A calibration with a few GEMM and stream samples, as the kernel tests below extend it.
Calibration small_calibration() {
  Calibration c;
  c.device_name = "test cpu";
  c.peak_f32 = 1e11, c.peak_bf16 = 2e11, c.memory_bytes = 8.0 * (1 << 30);
  c.bf16 = {{512, 512, 512, 1.6e11}, {64, 64, 64, 4e10}};
  c.f32 = {{512, 512, 512, 8e10}};
  c.stream = {{double(1 << 30), 40e9}};
  return c;
}

// Loom's measured kernels become hardware figures: the median attention rate, and the element-wise
// kernels' streaming rate over the triad's as the memory efficiency; they round-trip through TOML and
// slow the planner's attention and memory-bound time exactly where measured.
TEST(Calibrate, LoomsOwnKernelsBecomeTheAttentionRateAndTheMemoryEfficiency) {
  Calibration c = small_calibration();
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

// The bf16 attention kernels get their own measured rate: bf16 (and fp8) jobs run it, f32 jobs the
// f32 one, and a file without it prices both precisions at attention_tflops.
TEST(Calibrate, Bf16TrainingIsPricedAtTheBf16AttentionKernelsRate) {
  Calibration c = small_calibration();
  c.attention = {{{4, 256, 6, 64}, 2e10}};
  c.attention_bf16 = {{{4, 256, 6, 64}, 3e10}, {{1, 1024, 8, 64}, 5e10}, {{1, 2048, 8, 128}, 4e10}};
  Hardware hw = hardware_from_calibration(c);
  EXPECT_DOUBLE_EQ(hw.device.attention_bf16_flops, 4e10);
  Hardware back = parse_hardware(hardware_to_toml(hw, "test", {}), "rt.toml");
  EXPECT_NEAR(back.device.attention_bf16_flops, 4e10, 1e4);
  EXPECT_DOUBLE_EQ(back.device.attention_rate(true), back.device.attention_bf16_flops);
  EXPECT_DOUBLE_EQ(back.device.attention_rate(false), back.device.attention_flops);

  Job j;
  j.model = plan_model("mini");
  j.cluster = {hw, 1};
  j.seq = 256, j.global_batch = 8;
  const Layout l{.micro_batch = 8};
  j.precision = "bf16";
  const double bf16_attention = step_time(l, j).attention;
  j.precision = "f32";
  const double f32_attention = step_time(l, j).attention;
  EXPECT_NEAR(f32_attention / bf16_attention, 2.0, 1e-9) << "attention is priced at 20 vs 40 GFLOP/s";
  j.cluster.hw.device.attention_bf16_flops = 0;
  j.precision = "bf16";
  EXPECT_DOUBLE_EQ(step_time(l, j).attention, f32_attention) << "no bf16 rate: attention_tflops for both";
}


// `loom calibrate --model`'s attention at the model's own shapes ([[attention_table]]): a job whose
// shape is in the table is priced at that rate (the nearest batch, on a rank of a shared machine the
// per-rank row), any other at attention_tflops; the rows survive the round trip, and bad rows are named.
TEST(Calibrate, AttentionTimedAtTheModelsShapesPricesThoseShapes) {
  Calibration c = small_calibration();
  c.attention_bf16 = {{{1, 1024, 8, 64}, 4e10}};
  // mini: 6 heads of 64, T = 256; whole machine at B 8 and 2, one of 2 ranks at B 4; and an f32 row.
  c.engine_attention = {{8, 256, 6, 6, 64, 2, 1e10}, {8, 256, 6, 6, 64, 2, 3e10}, {2, 256, 6, 6, 64, 2, 3e10},
                        {4, 256, 6, 6, 64, 2, 0.5e10, 2}, {8, 256, 6, 6, 64, 4, 0.8e10}};
  const Hardware hw = hardware_from_calibration(c);
  ASSERT_EQ(hw.attention_table.size(), 4u) << "the two B 8 bf16 samples merge into their median";
  EXPECT_DOUBLE_EQ(hw.attention_rate(8, 256, 6, 6, 64, true), 2e10);
  EXPECT_DOUBLE_EQ(hw.attention_rate(6, 256, 6, 6, 64, true), 2e10) << "the nearest B: 8 (log distance)";
  EXPECT_DOUBLE_EQ(hw.attention_rate(2, 256, 6, 6, 64, true), 3e10);
  EXPECT_DOUBLE_EQ(hw.attention_rate(8, 256, 6, 6, 64, false), 0.8e10) << "f32 jobs: the f32 row";
  EXPECT_DOUBLE_EQ(hw.attention_rate(8, 512, 6, 6, 64, true), 4e10) << "another T: attention_bf16_tflops";
  EXPECT_DOUBLE_EQ(hw.attention_rate(8, 256, 6, 2, 64, true), 4e10) << "other KV heads: attention_bf16_tflops";
  const Hardware two = rank_share(hw, 2);
  EXPECT_DOUBLE_EQ(two.attention_rate(4, 256, 6, 6, 64, true), 0.5e10) << "a rank of two: its own row";
  EXPECT_DOUBLE_EQ(rank_share(hw, 4).attention_rate(8, 256, 6, 6, 64, true), 0.5e10) << "no 4-rank row: shared out";

  Job j;
  j.model = plan_model("mini");
  j.cluster = {hw, 1};
  j.seq = 256, j.global_batch = 8, j.precision = "bf16";
  const double at_b8 = step_time(Layout{.micro_batch = 8}, j).attention;
  Hardware no_table = hw;
  no_table.attention_table.clear();
  j.cluster.hw = no_table;
  EXPECT_NEAR(step_time(Layout{.micro_batch = 8}, j).attention / at_b8, 0.5, 1e-9)
      << "the table's 20 GFLOP/s, not attention_bf16_tflops' 40";

  const Hardware back = parse_hardware(hardware_to_toml(hw, "x", {}), "back.toml");
  ASSERT_EQ(back.attention_table.size(), 4u);
  EXPECT_EQ(back.attention_table[2].ranks, 2);
  EXPECT_NEAR(back.attention_rate(8, 256, 6, 6, 64, true), 2e10, 1e4);
  std::string text = hardware_to_toml(hw, "x", {});
  auto bad = [&](const std::string& from, const std::string& to, const std::string& message) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    try {
      parse_hardware(t, "bad.toml");
      ADD_FAILURE() << to << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  bad("kv_heads = 6", "kv_heads = 4", "attention_table[0]: heads = 6 must be a multiple of kv_heads = 4");
  bad("head_dim = 64\nbytes = 2", "head_dim = 64\nbytes = 3", "attention_table[0]: 'bytes' must be 2 (bf16 kernels) or 4");
  bad("t = 256", "t = -1", "attention_table[0]: 't' must be a positive number");
}

// `loom calibrate --model CONFIG`: the model's layer GEMMs, timed at the shapes its layouts run, are
// written as [[gemm_table]] and read back; the time model takes their rate for exactly those shapes and
// the curve for any other.
TEST(Calibrate, MeasuredLayerGemmsReplaceTheCurveForTheirShapes) {
  Hardware hw = parse_hardware(R"(
name = "cpu"
[device]
memory_GiB = 16
memory_bandwidth_GBps = 50
peak_tflops = { bf16 = 1, f32 = 0.5 }
[node]
devices = 1
[intra_node]
bandwidth_GBps = 10
latency_us = 1
[inter_node]
bandwidth_GBps = 10
latency_us = 1
[[gemm_table]]
m = 2048
n = 1152
k = 384
bytes = 2
tflops = 0.25
)", "cpu.toml");
  ASSERT_EQ(hw.gemm_table.size(), 1u);
  const double flops = 2.0 * 2048 * 1152 * 384;
  EXPECT_NEAR(gemm_time({2048, 1152, 384, 2}, hw, hw.peak("bf16"), 2), 2 * flops / 0.25e12, 1e-12);
  // Another element size, or another shape: the curve.
  const double curve = gemm_time({2048, 1152, 384}, hw, hw.peak("f32"), 4);
  EXPECT_NE(curve, flops / 0.25e12);
  EXPECT_NE(gemm_time({2048, 1152, 512}, hw, hw.peak("bf16"), 2), flops / 0.25e12 * 512 / 384);
  // Round trip, and a bad row named.
  const Hardware back = parse_hardware(hardware_to_toml(hw, "x", {}), "back.toml");
  ASSERT_EQ(back.gemm_table.size(), 1u);
  EXPECT_DOUBLE_EQ(back.gemm_table[0].flops_per_s, 0.25e12);
  std::string text = hardware_to_toml(hw, "x", {});
  text.replace(text.find("bytes = 2"), 9, "bytes = 3");
  try {
    parse_hardware(text, "bad.toml");
    FAIL() << "bytes = 3 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "bad.toml: gemm_table[0]: 'bytes' must be 1, 2 or 4");
  }

  namespace fs = std::filesystem;
  const fs::path file = fs::temp_directory_path() / ("loom-calibrate-model-" + std::to_string(::getpid()) + ".toml");
  auto r = test::run_loom("calibrate --quick --threads 1 --no-comm --model " LOOM_SOURCE_DIR "/configs/tiny.toml --out " +
                          file.string());
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  const Hardware measured = load_hardware(file.string());
  // tiny (fp32, batch 8 x 64): rows 512, 256 and 128, tp 1 and 2, five GEMMs each, one rate per shape.
  ASSERT_LE(measured.gemm_table.size(), 30u);
  ASSERT_GE(measured.gemm_table.size(), 20u);
  for (size_t i = 0; i < measured.gemm_table.size(); ++i)
    for (size_t j = 0; j < i; ++j) {
      const auto &a = measured.gemm_table[i], &b = measured.gemm_table[j];
      EXPECT_FALSE(a.M == b.M && a.N == b.N && a.K == b.K && a.bytes == b.bytes) << "shape " << a.M << "x" << a.N << "x" << a.K << " twice";
    }
  for (const auto& g : measured.gemm_table) {
    EXPECT_EQ(g.bytes, 4);
    EXPECT_TRUE(g.M == 512 || g.M == 256 || g.M == 128) << g.M;
    EXPECT_GT(g.flops_per_s, 0);
  }
  // Its attention at B = 8, 4 and 2 sequences of 64 tokens, whole heads and split by tp 2.
  ASSERT_EQ(measured.attention_table.size(), 6u);
  for (const auto& a : measured.attention_table) {
    EXPECT_EQ(a.T, 64);
    EXPECT_EQ(a.bytes, 4) << "tiny trains in fp32";
    EXPECT_TRUE(a.B == 8 || a.B == 4 || a.B == 2) << a.B;
    EXPECT_GT(a.flops_per_s, 0);
  }
  fs::remove(file);
  r = test::run_loom("calibrate --quick --no-comm --model /no/such.toml --out " + file.string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE((r.out + r.err).find("--model"), std::string::npos) << r.out << r.err;
}

// A CPU machine shared by a job's ranks: each rank gets its share of the peaks and bandwidth, and its
// GEMMs run at the per-rank rates timed at that many ranks where the file has them ([[gemm_table]]
// with ranks = R), else at the whole machine's rates shared out. Collectives on staged (plain) buffers
// use staged_intra_node where the file has it. All of it survives the round trip through the file.
TEST(Calibrate, SharedMachinesUsePerRankGemmRatesAndStagedLinks) {
  // A CPU file as calibrate writes one: shared-memory links, registered and staged.
  const std::string machine = "name = \"cpu\"\n[device]\nmemory_GiB = 16\nmemory_bandwidth_GBps = 50\n"
                              "peak_tflops = { bf16 = 1, f32 = 0.5 }\n[node]\ndevices = 1\n"
                              "[intra_node]\nbandwidth_GBps = 10\nlatency_us = 1\ntopology = \"shared_memory\"\n"
                              "[staged_intra_node]\nbandwidth_GBps = 2\nlatency_us = 100\n"
                              "[inter_node]\nbandwidth_GBps = 10\nlatency_us = 1\n";
  Hardware hw = parse_hardware(machine + R"(
[[gemm_table]]
m = 1024
n = 1152
k = 384
bytes = 2
tflops = 0.6
[[gemm_table]]
m = 1024
n = 1152
k = 384
bytes = 2
tflops = 0.35
ranks = 2
)", "cpu.toml");
  ASSERT_EQ(hw.gemm_table.size(), 2u);
  const GemmShape g{1024, 1152, 384, 1};
  const double flops = 2.0 * 1024 * 1152 * 384;
  // The whole machine reads only the whole-machine rate.
  EXPECT_NEAR(gemm_time(g, hw, hw.peak("bf16"), 2), flops / 0.6e12, 1e-12);
  const Hardware two = rank_share(hw, 2);
  EXPECT_DOUBLE_EQ(two.device.peak_bf16, 0.5e12);
  EXPECT_DOUBLE_EQ(two.device.memory_bandwidth, 25e9);
  EXPECT_EQ(two.devices_per_node, 2);
  EXPECT_NEAR(gemm_time(g, two, two.peak("bf16"), 2), flops / 0.35e12, 1e-12) << "the rate timed per rank";
  const Hardware four = rank_share(hw, 4);
  EXPECT_NEAR(gemm_time(g, four, four.peak("bf16"), 2), flops / 0.15e12, 1e-12) << "no per-rank entry: shared out";
  EXPECT_NEAR(gemm_time(g, rank_share(hw, 1), hw.peak("bf16"), 2), flops / 0.6e12, 1e-12);
  // Staged collectives take their own link inside a node; registered ones (and no staged link) intra_node.
  const GroupShape pair{2, 2};
  const double mb = 1 << 20;
  EXPECT_GT(group_collective_time(Collective::AllReduce, mb, pair, hw, true),
            4 * group_collective_time(Collective::AllReduce, mb, pair, hw));
  Hardware no_staged = hw;
  no_staged.staged_intra_node = {};
  EXPECT_DOUBLE_EQ(group_collective_time(Collective::AllReduce, mb, pair, no_staged, true),
                   group_collective_time(Collective::AllReduce, mb, pair, hw));
  // Round trip.
  const Hardware back = parse_hardware(hardware_to_toml(hw, "x", {}), "back.toml");
  ASSERT_EQ(back.gemm_table.size(), 2u);
  EXPECT_EQ(back.gemm_table[1].ranks, 2);
  EXPECT_DOUBLE_EQ(back.staged_intra_node.bandwidth, 2e9);
  EXPECT_DOUBLE_EQ(back.staged_intra_node.latency, 100e-6);
  std::string text = hardware_to_toml(hw, "x", {});
  text.replace(text.find("ranks = 2"), 9, "ranks = 0");
  try {
    parse_hardware(text, "bad.toml");
    FAIL() << "ranks = 0 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("gemm_table[1]: 'ranks' must be an integer in [1, 65536]"), std::string::npos)
        << e.what();
  }
}

// `loom calibrate --model` with its collectives times the model's layer GEMMs a second time per rank of
// a 2-rank job (`loom bench gemm` under `loom run -n 2`), and measures staged collectives too.
TEST(Calibrate, TimesTheLayerGemmsPerRankOfTheRanksItMeasuresCollectivesOn) {
  namespace fs = std::filesystem;
  const fs::path file = fs::temp_directory_path() / ("loom-calibrate-ranks-" + std::to_string(::getpid()) + ".toml");
  auto r = test::run_loom("calibrate --quick --threads 1 --model " LOOM_SOURCE_DIR "/configs/tiny.toml --out " +
                          file.string());
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  const Hardware hw = load_hardware(file.string());
  size_t whole = 0, per_rank = 0;
  for (const auto& g : hw.gemm_table) {
    EXPECT_GT(g.flops_per_s, 0);
    (g.ranks == 1 ? whole : per_rank) += 1;
    EXPECT_TRUE(g.ranks == 1 || g.ranks == 2) << g.ranks;
  }
  EXPECT_GE(whole, 20u);
  EXPECT_EQ(per_rank, whole) << "every shape timed per rank too";
  size_t attention_per_rank = 0;
  for (const auto& a : hw.attention_table) attention_per_rank += a.ranks == 2;
  EXPECT_EQ(attention_per_rank * 2, hw.attention_table.size()) << "attention timed per rank too";
  EXPECT_GT(hw.staged_intra_node.bandwidth, 0);
  fs::remove(file);
  // The benchmark itself, one copy per rank: every rank reports every shape.
  auto b = test::run_loom("run -n 2 -- loom bench gemm --json --budget 0.001 --config " LOOM_SOURCE_DIR
                          "/configs/tiny.toml");
  ASSERT_EQ(b.rc, 0) << b.out << b.err;
  EXPECT_NE(b.out.find("\"rank\":0"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("\"rank\":1"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("\"attention_tflops\""), std::string::npos) << b.out;
}
