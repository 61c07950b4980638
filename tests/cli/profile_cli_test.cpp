// `loom profile report` end to end: a traced 2-rank run's directory (its manifest names the trace, the
// peak and the model's FLOPs) gives a per-rank table, kernels against the roofline, MFU and a verdict;
// --json carries the same; runs without a trace and files that are not traces are refused in one line.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "cli_runner.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

TEST(ProfileCli, ReportsATracedRunsStepsAndVerdict) {
  auto dir = scratch_dir("profile-report");
  const std::string out = (dir / "run").string();
  auto r = run_loom("run -n 2 -- loom train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --quiet --set train.steps=6 "
                    "--set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.dp=2 --set train.out_dir=" +
                    out + " --set trace.file=" + out + "/trace.json");
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run_loom("profile report " + out + " --bandwidth 1e10");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("2 rank(s), 4 step(s) analysed per rank"));
  EXPECT_THAT(r.out, HasSubstr("compute (union)"));
  EXPECT_THAT(r.out, HasSubstr("gemm_fwd"));
  EXPECT_THAT(r.out, HasSubstr("MFU "));
  EXPECT_THAT(r.out, HasSubstr("verdict: bound by "));
  EXPECT_THAT(r.out, HasSubstr("slowest rank: "));
  r = run_loom("profile report " + out + "/trace.json --json --peak-flops 1e11 --bandwidth 1e10");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["ranks"].size(), 2u);
  EXPECT_GT(j["job"]["compute_s"].get<double>(), 0);
  EXPECT_LE(j["job"]["compute_s"].get<double>(), j["job"]["step_s"].get<double>());
  EXPECT_FALSE(j["verdict"]["bound_by"].get<std::string>().empty());
  EXPECT_EQ(j["mfu"].get<double>(), 0) << "a trace alone has no manifest to count model FLOPs";
  fs::remove_all(dir);
}

// Issue 14 item 3: the report puts the planner's prediction for the run's own layout (--engine loom)
// beside the measurement, class by class, and names the term that misses most. With a machine file each
// rank gets its share of a one-device CPU machine; without one, the report's roofline.
TEST(ProfileCli, ThePlannersPredictionStandsBesideTheMeasurement) {
  auto dir = scratch_dir("profile-planner");
  const std::string out = (dir / "run").string(), machine = (dir / "machine.toml").string();
  auto r = run_loom("run -n 2 -- loom train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --quiet --set train.steps=5 "
                    "--set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.tp=2 "
                    "--set parallel.sequence_parallel=true --set train.out_dir=" + out + " --set trace.file=" + out +
                    "/trace.json");
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run_loom("profile report " + out + " --bandwidth 1e10");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("planner (software loom (flash attention, DP overlapped"));
  EXPECT_THAT(r.out, HasSubstr(") for layout"));
  EXPECT_THAT(r.out, HasSubstr("the report's roofline"));
  EXPECT_THAT(r.out, HasSubstr("memory-bound kernels"));
  EXPECT_THAT(r.out, HasSubstr("worst error over the classes that count"));
  {
    std::ofstream f(machine);
    f << "name = \"test-cpu\"\nsource = \"written by the test\"\n[device]\nname = \"cpu\"\nmemory_GiB = 16\n"
         "memory_bandwidth_GBps = 20\npeak_tflops = { bf16 = 0.2, fp8 = 0, f32 = 0.25 }\nattention_tflops = 0.05\n"
         "[node]\ndevices = 1\n[intra_node]\nbandwidth_GBps = 8\nlatency_us = 1\ntopology = \"shared_memory\"\n"
         "[inter_node]\nbandwidth_GBps = 1\nlatency_us = 10\n"
         "[efficiency]\ngemm_max = 0.9\ngemm_half_dim = 8\nmemory = 0.8\nlink = 0.8\n";
  }
  r = run_loom("profile report " + out + " --machine " + machine + " --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_TRUE(j.contains("planner")) << r.out;
  const auto& p = j["planner"];
  EXPECT_THAT(p["hardware"].get<std::string>(), HasSubstr("one device shared by 2 ranks"));
  EXPECT_THAT(p["layout"].get<std::string>(), HasSubstr("tp2"));
  ASSERT_FALSE(p.contains("refused")) << p.dump();
  std::set<std::string> classes;
  for (const auto& c : p["classes"]) {
    classes.insert(c["class"].get<std::string>());
    EXPECT_GE(c["measured_s"].get<double>(), 0);
    EXPECT_GE(c["predicted_s"].get<double>(), 0);
  }
  for (const char* c : {"GEMM", "attention", "memory-bound kernels", "exposed communication", "host overhead", "step"})
    EXPECT_TRUE(classes.count(c)) << c;
  EXPECT_GT(p["classes"].back()["predicted_s"].get<double>(), 0);
  EXPECT_GT(p["classes"].back()["measured_s"].get<double>(), 0);
  EXPECT_THAT(p["classes"][1]["term"].get<std::string>(), HasSubstr("attention_tflops"));
  EXPECT_TRUE(p.contains("most_wrong"));
  EXPECT_GE(p["worst_error"].get<double>(), 0);
  fs::remove_all(dir);
}

// The HTML report is one self-contained page (nothing fetched) that a browser renders: headless
// Chromium (installed by scripts/setup.sh) takes a screenshot that is not blank, and the page it built
// holds the verdict.
TEST(ProfileCli, TheHtmlReportRendersInAHeadlessBrowser) {
  auto dir = scratch_dir("profile-html");
  const std::string out = (dir / "run").string(), html = (dir / "report.html").string();
  auto r = run_loom("run -n 2 -- loom train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --quiet --set train.steps=5 "
                    "--set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.dp=2 --set train.out_dir=" +
                    out + " --set trace.file=" + out + "/trace.json");
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run_loom("profile report " + out + " --bandwidth 1e10 --peak-flops 1e11 --html " + html);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("HTML report written to " + html));
  std::ifstream in(html);
  const std::string page((std::istreambuf_iterator<char>(in)), {});
  EXPECT_THAT(page, HasSubstr("<svg"));
  EXPECT_THAT(page, HasSubstr("verdict: bound by "));
  EXPECT_THAT(page, HasSubstr("One step across ranks"));
  EXPECT_EQ(page.find("src="), std::string::npos) << "nothing is loaded from elsewhere";
  EXPECT_EQ(page.find("<script"), std::string::npos);
  if (run_shell("command -v chromium").rc != 0) GTEST_SKIP() << "chromium is not installed (scripts/setup.sh installs it)";
  const std::string png = (dir / "report.png").string(), profile = (dir / "chromium").string();
  const std::string chromium = "timeout 120 chromium --headless --no-sandbox --disable-gpu --user-data-dir=" + profile;
  r = run_shell(chromium + " --window-size=1300,1000 --screenshot=" + png + " file://" + html);
  ASSERT_TRUE(fs::exists(png)) << r.err;
  // Not blank: the page's colors (the verdict box, the bars, the timeline) are on the screenshot.
  r = run_shell("/usr/bin/python3 -c \"import sys; from PIL import Image; im = Image.open(sys.argv[1]); "
                "print(len(im.getcolors(1 << 24)))\" " + png);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_GT(std::stoi(r.out), 20) << "distinct colors on the screenshot";
  r = run_shell(chromium + " --dump-dom file://" + html);
  EXPECT_THAT(r.out, HasSubstr("verdict: bound by "));
  fs::remove_all(dir);
}

TEST(ProfileCli, WhatIsNotATraceIsRefusedInOneLine) {
  auto dir = scratch_dir("profile-bad");
  const std::string out = (dir / "run").string();
  ASSERT_EQ(run_loom("train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --quiet --set train.steps=2 --set train.eval_every=0 "
                     "--set checkpoint.save_every=0 --set train.out_dir=" + out).rc, 0);
  auto r = run_loom("profile report " + out);
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("wrote no trace: train with --set trace.file="));
  r = run_loom("profile report " + out + "/metrics.jsonl");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("is not JSON"));
  r = run_loom("profile report " + (dir / "nothing").string());
  EXPECT_THAT(r.err, HasSubstr("cannot read trace"));
  fs::remove_all(dir);
}

// A rank that stops before a collective (a test-only fault) hangs the job: the others time out, every
// rank still running leaves its flight records, and `loom profile hang` names the collective and the
// rank that never joined it.
TEST(ProfileCli, AHangNamesTheCollectiveAndTheRankThatNeverJoined) {
  auto dir = scratch_dir("profile-hang");
  const std::string out = (dir / "run").string();
  auto r = run_loom("run -n 3 -- loom train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --quiet --set train.steps=20 "
                    "--set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.dp=3 --set train.batch_size=6 "
                    "--set train.out_dir=" + out,
                    "LOOM_COMM_TIMEOUT=3 LOOM_FAULT_INJECT=hang_before_collective:1:20");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("rank(s) 1 never arrived"));
  r = run_loom("profile hang " + out);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("entered it and waited: rank(s) 0, 2"));
  EXPECT_THAT(r.out, HasSubstr("never joined: rank 1"));
  EXPECT_THAT(r.out, HasSubstr("the hang: rank(s) 1 never joined "));
  EXPECT_THAT(r.out, HasSubstr("#20"));
  r = run_loom("profile hang " + (dir / "nothing").string());
  EXPECT_THAT(r.err, HasSubstr("no flight records in"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom::test
