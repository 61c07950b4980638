// End-to-end tests of `loom train` as a user runs it: the binary, a config, the files it leaves.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"

namespace fs = std::filesystem;

using loom::test::run_loom;

namespace {
std::filesystem::path scratch(const std::string& name) {
  auto d = loom::test::scratch_dir(name);
  std::filesystem::remove_all(d);  // `loom train` creates it
  return d;
}
auto run(const std::string& args) { return run_loom(args); }
}  // namespace

TEST(TrainCli, TrainsTinyAndLeavesMetricsManifestAndTrace) {
  auto dir = scratch("run");
  auto trace = dir / "traces" / "trace.json";  // a folder that does not exist yet is made
  auto r = run("train --config " LOOM_SOURCE_DIR
               "/configs/tiny.toml --set train.steps=8 --set train.eval_every=4 --set train.out_dir=" +
               dir.string() + " --trace " + trace.string() + " --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto summary = nlohmann::json::parse(r.out);
  EXPECT_EQ(summary["framework"], "loom");
  EXPECT_GT(summary["tokens_per_s"].get<double>(), 0);
  EXPECT_TRUE(summary.contains("val_loss"));
  EXPECT_NE(r.err.find("step 8/8"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("split: gemm"), std::string::npos) << r.err;

  std::ifstream metrics(dir / "metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"].get<int>(), ++lines);
    for (auto key : {"loss", "lr", "grad_norm", "step_s", "tokens_per_s", "mfu", "tokens", "elapsed_s"})
      EXPECT_TRUE(j.contains(key)) << key;
    EXPECT_EQ(j.contains("val_loss"), lines % 4 == 0);
  }
  EXPECT_EQ(lines, 8);

  std::ifstream mf(dir / "manifest.json");
  auto manifest = nlohmann::json::parse(mf);
  EXPECT_NE(manifest["config_toml"].get<std::string>().find("preset = \"tiny\""), std::string::npos);
  EXPECT_FALSE(manifest["backend"].get<std::string>().empty());

  std::ifstream tf(trace);
  auto t = nlohmann::json::parse(tf);
  bool saw_gemm = false;
  for (auto& ev : t["traceEvents"])
    if (ev.value("cat", "") == "gemm") saw_gemm = ev["args"]["flops"].get<double>() > 0 || saw_gemm;
  EXPECT_TRUE(saw_gemm);
  fs::remove_all(dir);
}

// --version (and every run's manifest) names the commit the binary was built from: it was captured
// when CMake configured the build folder, and went stale with every later commit.
TEST(TrainCli, VersionNamesTheCommitTheBinaryWasBuiltFrom) {
  std::string head;
  if (FILE* p = popen("git -C " LOOM_SOURCE_DIR " rev-parse --short HEAD 2>/dev/null", "r")) {
    char buf[64] = {};
    if (std::fgets(buf, sizeof buf, p)) head = buf;
    pclose(p);
  }
  while (!head.empty() && (head.back() == '\n' || head.back() == ' ')) head.pop_back();
  auto r = run("--version");
  ASSERT_EQ(r.rc, 0) << r.err;
  if (head.empty()) GTEST_SKIP() << "no git checkout: " << r.out;
  // The binary may be a build of HEAD with local changes ("-dirty"), never of another commit.
  EXPECT_NE(r.out.find("(" + head), std::string::npos) << r.out << " vs HEAD " << head;
}

// A trace path that cannot be written is refused before the first step (it was refused after the
// whole run, losing its trace), and nothing of the run is written.
TEST(TrainCli, AnUnwritableTracePathIsRefusedBeforeAnyWork) {
  auto dir = scratch("bad-trace");
  fs::create_directories(dir);
  std::ofstream(dir / "a-file") << "x";
  for (const auto& [trace, expect] : std::vector<std::pair<fs::path, std::string>>{
           {dir / "a-file" / "trace.json", "cannot create the folder"}, {dir, "is a folder"}}) {
    auto r = run("train --set model.preset=tiny --set train.steps=2 --set train.out_dir=" + (dir / "out").string() +
                 " --save-dir " + (dir / "ck").string() + " --trace " + trace.string() + " -q");
    EXPECT_EQ(r.rc, 1) << r.err;
    EXPECT_NE(r.err.find("loom: error: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dir / "ck")) << "a checkpoint was written before the refusal";
    EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl"));
  }
  fs::remove_all(dir);
}

// The same for the checkpoint folder: it is made by the first save, and a save that fails after the
// run's steps lost them all.
TEST(TrainCli, AnUnwritableCheckpointFolderIsRefusedBeforeAnyWork) {
  auto dir = scratch("bad-ckpt");
  fs::create_directories(dir);
  std::ofstream(dir / "a-file") << "x";
  auto r = run("train --set model.preset=tiny --set train.steps=2 --set train.out_dir=" + (dir / "out").string() +
               " --save-dir " + (dir / "a-file" / "ck").string() + " --save-every 2 -q");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("loom: error: checkpoint.dir"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is a file, not a folder"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 1"), std::string::npos) << "no step may run before the refusal\n" << r.err;
  EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl"));
  fs::remove_all(dir);
}

// More validation batches than the validation split holds read each sample once, not the split over
// and over (a million batches of a 22-window split ran for hours and looked hung).
TEST(TrainCli, ValidationReadsTheSplitAtMostOnce) {
  auto dir = scratch("eval-cap");
  ASSERT_EQ(run("prepare --input /usr/share/games/fortunes/art --out " + (dir / "d").string() +
                " --vocab-size 512 --threads 1 --quiet")
                .rc,
            0);
  auto r = run("train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set train.steps=2 --set train.eval_every=1 "
               "--set train.eval_batches=1000000 --set data.source=shards --set model.vocab_size=512 --set data.dir=" +
               (dir / "d").string() + " --set train.out_dir=" + (dir / "out").string() + " --save-dir " +
               (dir / "ck").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("note: train.eval_batches = 1000000 is more than one pass over the validation split"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("val "), std::string::npos) << r.err;
  fs::remove_all(dir);
}

TEST(TrainCli, QuietPrintsNothingButTheJsonSummary) {
  auto dir = scratch("quiet");
  auto r =
      run("train --set model.preset=tiny --set train.steps=2 --set train.out_dir=" + dir.string() + " --quiet --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NO_THROW(nlohmann::json::parse(r.out));
  // A second run in the same folder keeps the first run's log beside its own.
  ASSERT_EQ(run("train --set model.preset=tiny --set train.steps=3 --set train.out_dir=" + dir.string() + " -q").rc, 0);
  int kept = 0;
  for (auto& e : std::filesystem::directory_iterator(dir))
    kept += e.path().filename().string().rfind("metrics-", 0) == 0;
  EXPECT_EQ(kept, 1);
  fs::remove_all(dir);
}

TEST(TrainCli, BadInputIsOneClearLineAndANonZeroExit) {
  struct Case {
    std::string args, expect;
  };
  for (const auto& c : std::vector<Case>{
           {"train --set train.wramup_steps=1", "did you mean 'train.warmup_steps'"},
           {"train --set model.preset=tiny --set model.n_heads=5", "not divisible by model.n_heads"},
           {"train --set model.preset=tiny-llama --set model.n_kv_heads=3", "must divide model.n_heads"},
           {"train --set parallel.dp=4", "needs 4 ranks but the job has 1"},
           {"train --set parallel.ep=2", "needs a mixture-of-experts model"},
           {"train --set parallel.cp=2 --set parallel.cp_mode=zigzag", "is not a context-parallel mode"},
           {"train --set precision=fp4", "precision = 'fp4' is not supported"},
           {"train --set train.steps=abc", "train.steps must be an integer"},
       }) {
    auto r = run(c.args);
    EXPECT_EQ(r.rc, 1) << c.args;
    EXPECT_NE(r.err.find("loom: error: "), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.args << "\n" << r.err;
  }
  auto missing = run("train --config /nonexistent/x.toml");
  EXPECT_NE(missing.rc, 0);
  EXPECT_NE(missing.err.find("x.toml"), std::string::npos) << missing.err;
}

TEST(TrainCli, HelpDocumentsEveryConfigKey) {
  auto r = run("train --help");
  ASSERT_EQ(r.rc, 0);
  for (auto key : {"model.preset", "train.micro_batch_size", "precision", "parallel.zero", "trace.file"})
    EXPECT_NE(r.out.find(key), std::string::npos) << key;
}

TEST(TrainCli, ImpossibleSizesAndBadFlagsAreOneLineErrorsBeforeAnyWork) {
  // Overflowed to a small byte count on main and crashed in ParameterStore::initialize.
  auto r =
      run("train --set model.d_model=759249034 --set model.n_heads=1 --set model.n_kv_heads=1 "
          "--set model.vocab_size=1000 --set train.seq_len=1 -q");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("loom: error: model.d_model = 759249034 is out of range"), std::string::npos) << r.err;
  // Within every range, but more memory than this machine has: refused with the per-category need.
  r = run("train --set model.d_model=65536 --set model.n_heads=1 --set model.n_kv_heads=1 -q");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("GiB per rank (parameters"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("but the machine has"), std::string::npos) << r.err;
  // CLI flags that stand for config keys obey the keys' ranges.
  r = run("train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --save-every -1 -q");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("checkpoint.save_every = -1 is out of range"), std::string::npos) << r.err;
  // Other commands' numeric flags are checked too (was silently 0).
  r = run("generate --checkpoint nowhere --top-k -3");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--top-k: -3 is out of range"), std::string::npos) << r.err;
  r = run("generate --checkpoint nowhere --temperature nan");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--temperature: nan is out of range"), std::string::npos) << r.err;
  // Each line above is one line: no stack of messages.
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("loom: error: --temperature"), std::string::npos) << r.err;
  // Flags that exclude each other, and numeric flags out of range, the same way.
  r = run("generate --checkpoint nowhere --prompt x --prompt-ids \"1 2\"");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("loom: error: --prompt excludes --prompt-ids"), std::string::npos) << r.err;
  r = run("verify --config " LOOM_SOURCE_DIR "/configs/tiny.toml --layouts \"dp=1;dp=2\" --tolerance -1");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_NE(r.err.find("--tolerance: -1 is out of range"), std::string::npos) << r.err;
}

// A loss spike (z-score over the last applied steps) is not applied when train.loss_spike_zscore is set:
// with a bar this low, the first rise of the loss over its recent mean is skipped and said so.
TEST(TrainCli, ALossSpikeIsSkippedWhenAsked) {
  auto dir = loom::test::scratch_dir("spike");
  auto r = run_loom("train --config " LOOM_SOURCE_DIR
                    "/configs/tiny.toml --quiet --json --set train.steps=20 "
                    "--set train.eval_every=0 --set checkpoint.save_every=0 --set train.loss_spike_zscore=0.01 "
                    "--set train.loss_spike_window=2 --set train.max_consecutive_skips=100 --set train.out_dir=" +
                    (dir / "out").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_GT(nlohmann::json::parse(r.out)["skipped_steps"].get<int>(), 0);
  std::ifstream log(dir / "out" / "metrics.jsonl");
  int spikes = 0;
  for (std::string line; std::getline(log, line);) {
    const auto m = nlohmann::json::parse(line);
    if (m.value("skipped", false)) {
      EXPECT_NE(m["skip_reason"].get<std::string>().find("is a spike"), std::string::npos) << line;
      ++spikes;
    }
  }
  EXPECT_GT(spikes, 0);
  std::filesystem::remove_all(dir);
}
