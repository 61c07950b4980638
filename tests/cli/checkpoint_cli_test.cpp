// Checkpoints as a user meets them: save, resume bitwise, survive kills and a full disk at every
// phase of a save, detect corruption, prune only this run's checkpoints, save on SIGTERM.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli_runner.h"

namespace fs = std::filesystem;
using loom::test::run_loom;

namespace {

// A tiny run: fast steps, a checkpoint every 2 of them.
std::string train_args(const fs::path& root, int steps, const std::string& extra = "", int save_every = 2) {
  return "train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set train.steps=" + std::to_string(steps) +
         " --set train.eval_every=0 --set train.batch_size=4 --set train.seq_len=32 --set train.out_dir=" +
         (root / "out").string() + " --save-dir " + (root / "ck").string() + " --save-every " + std::to_string(save_every) +
         " " + extra;
}

std::vector<double> losses(const fs::path& root) {
  std::vector<double> out;
  std::ifstream in(root / "out" / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

// Flips one bit of the byte `from_end` bytes before the end of `file` (inside the last tensors' data).
void flip_byte(const fs::path& file, int64_t from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto at = static_cast<std::streamoff>(static_cast<int64_t>(fs::file_size(file)) - from_end);
  char c = 0;
  f.seekg(at);
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
}

std::string latest(const fs::path& root) {
  std::ifstream in(root / "ck" / "latest");
  std::string s;
  in >> s;
  return s;
}

}  // namespace

TEST(Checkpoint, ResumeContinuesBitwiseIdentically) {
  auto whole = loom::test::scratch_dir("ck-whole"), split = loom::test::scratch_dir("ck-split");
  ASSERT_EQ(run_loom(train_args(whole, 6)).rc, 0);
  ASSERT_EQ(run_loom(train_args(split, 4)).rc, 0);
  auto r = run_loom(train_args(split, 6, "--resume"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("resumed from"), std::string::npos);
  EXPECT_NE(r.err.find("train.steps"), std::string::npos) << "the changed schedule length is reported";
  auto a = losses(whole), b = losses(split);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);  // the resumed run appends to the metrics of the first
  // Steps 5 and 6 ran on a checkpoint from a 4-step schedule, whose cosine ends at step 4: compare
  // against a run resumed from the 6-step run's own checkpoint instead.
  auto again = loom::test::scratch_dir("ck-again");
  fs::copy(whole / "ck", again / "ck", fs::copy_options::recursive);
  std::ofstream(again / "ck" / "latest") << "step-00000004\n";
  auto r2 = run_loom(train_args(again, 6, "--resume"));
  ASSERT_EQ(r2.rc, 0) << r2.err;
  auto c = losses(again);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0], a[4]);  // bitwise
  EXPECT_EQ(c[1], a[5]);
  for (auto& d : {whole, split, again}) fs::remove_all(d);
}

// bf16-sr: a resumed run's bf16 weight copies are the ones the interrupted run's last update wrote
// (stochastic rounding keyed by the restored update step), so it continues bitwise.
TEST(Checkpoint, StochasticRoundingResumesBitwise) {
  auto whole = loom::test::scratch_dir("ck-sr-whole"), again = loom::test::scratch_dir("ck-sr-again");
  ASSERT_EQ(run_loom(train_args(whole, 6, "--set precision=bf16-sr")).rc, 0);
  fs::copy(whole / "ck", again / "ck", fs::copy_options::recursive);
  std::ofstream(again / "ck" / "latest") << "step-00000004\n";
  auto r = run_loom(train_args(again, 6, "--set precision=bf16-sr --resume"));
  ASSERT_EQ(r.rc, 0) << r.err;
  auto a = losses(whole), c = losses(again);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0], a[4]);  // bitwise
  EXPECT_EQ(c[1], a[5]);
  for (auto& d : {whole, again}) fs::remove_all(d);
}

// A kill at each phase of a save (and at a random byte of its tensor data) leaves the previous
// checkpoint whole and `latest` on it; the run then resumes. Synchronous saves, and asynchronous ones
// (the periodic save of step 4 dies on the background thread while training goes on).
TEST(Checkpoint, AKillAtAnyPhaseOfASaveLeavesThePreviousCheckpointLoadable) {
  std::mt19937 rng(static_cast<unsigned>(std::random_device{}()));
  const unsigned seed = rng();
  std::printf("random kill points from seed %u\n", seed);
  std::mt19937 pick(seed);
  std::vector<std::string> faults = {"tensor_data", "manifest", "fsync", "rename", "latest"};
  for (int i = 0; i < 2; ++i) faults.push_back("bytes:" + std::to_string(1 + pick() % 900000));
  for (const bool async : {false, true})
    for (const auto& fault : faults) {
      SCOPED_TRACE(fault + (async ? " (asynchronous)" : ""));
      auto root = loom::test::scratch_dir("ck-kill");
      ASSERT_EQ(run_loom(train_args(root, 2)).rc, 0);
      ASSERT_EQ(latest(root), "step-00000002");
      const int steps = async ? 6 : 4;
      const std::string resume = async ? "--resume --set checkpoint.async=true" : "--resume";
      auto killed = run_loom(train_args(root, steps, resume), "LOOM_FAULT_INJECT=" + fault);
      EXPECT_EQ(killed.rc, 86) << killed.err;  // the injected crash
      EXPECT_EQ(latest(root), "step-00000002") << "latest moved before the new checkpoint was durable";
      auto inspect = run_loom("ckpt inspect " + (root / "ck").string());
      EXPECT_EQ(inspect.rc, 0) << inspect.out << inspect.err;
      auto resumed = run_loom(train_args(root, steps, resume));
      EXPECT_EQ(resumed.rc, 0) << resumed.err;
      EXPECT_NE(resumed.err.find("resumed from " + (root / "ck" / "step-00000002").string()), std::string::npos)
          << resumed.err;
      EXPECT_EQ(latest(root), async ? "step-00000006" : "step-00000004");
      for (auto& e : fs::directory_iterator(root / "ck"))
        EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << "a crashed save's folder was left behind";
      fs::remove_all(root);
    }
}

// A restarted job (`loom run --max-restarts`: LOOM_RESTART_COUNT > 0) continues from the newest complete
// save, also one a crash left between its rename and the `latest` update, and logs every step once.
TEST(Checkpoint, ARestartContinuesFromTheNewestCompleteSaveEvenWhenLatestLagsBehind) {
  auto root = loom::test::scratch_dir("ck-restart");
  ASSERT_EQ(run_loom(train_args(root, 2)).rc, 0);
  auto killed = run_loom(train_args(root, 4, "--resume"), "LOOM_FAULT_INJECT=latest");
  ASSERT_EQ(killed.rc, 86) << killed.err;
  ASSERT_EQ(latest(root), "step-00000002");
  ASSERT_TRUE(fs::exists(root / "ck" / "step-00000004" / "manifest.json"));
  // The crashed attempt logged steps 3 and 4 before it died; the restart runs neither again.
  const std::string restart = "LOOM_RANK=0 LOOM_WORLD_SIZE=1 LOOM_RESTART_COUNT=1";
  auto resumed = run_loom(train_args(root, 6), restart);
  ASSERT_EQ(resumed.rc, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("restart 1 of the job: continuing from " + (root / "ck" / "step-00000004").string()),
            std::string::npos) << resumed.err;
  EXPECT_EQ(latest(root), "step-00000006");
  auto whole = loom::test::scratch_dir("ck-restart-whole");
  ASSERT_EQ(run_loom(train_args(whole, 6)).rc, 0);
  EXPECT_EQ(losses(root), losses(whole)) << "every step once, bitwise the uninterrupted run's";
  // The checkpoint the first attempt resumed from was pruned since: the restart takes the newest.
  fs::remove_all(root / "ck" / "step-00000002");
  auto pruned = run_loom(train_args(root, 8, "--resume-from " + (root / "ck" / "step-00000002").string()), restart);
  EXPECT_EQ(pruned.rc, 0) << pruned.err;
  EXPECT_NE(pruned.err.find("continuing from " + (root / "ck" / "step-00000006").string()), std::string::npos)
      << pruned.err;
  // Nothing saved yet: a restart starts again from step 0.
  auto fresh = loom::test::scratch_dir("ck-restart-fresh");
  auto again = run_loom(train_args(fresh, 2), restart);
  EXPECT_EQ(again.rc, 0) << again.err;
  EXPECT_NE(again.err.find("no checkpoint was saved, starting again from step 0"), std::string::npos) << again.err;
}

// A full disk fails the save with a clear error and keeps the previous checkpoint: a synchronous save at
// once; an asynchronous one (step 4's, on the background thread) at the next step boundary.
TEST(Checkpoint, AFullDiskFailsTheSaveWithAClearErrorAndKeepsThePreviousOne) {
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "asynchronous" : "synchronous");
    auto root = loom::test::scratch_dir("ck-full");
    ASSERT_EQ(run_loom(train_args(root, 2)).rc, 0);
    // 300 KiB per file: the metrics fit, tiny's 1 MB model.safetensors does not.
    auto r = run_loom(train_args(root, async ? 8 : 4, async ? "--resume --set checkpoint.async=true" : "--resume"),
                      "ulimit -f 300;");
    EXPECT_EQ(r.rc, 1) << r.err;
    EXPECT_NE(r.err.find("saving the checkpoint of step 4 failed"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("file too large"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("previous checkpoint"), std::string::npos) << r.err;
    EXPECT_EQ(latest(root), "step-00000002");
    EXPECT_EQ(run_loom(train_args(root, 4, "--resume")).rc, 0);
    fs::remove_all(root);
  }
}

// checkpoint.async: periodic saves are copied at the step boundary and written behind training.
TEST(Checkpoint, AsynchronousSavesAreBitwiseTheSynchronousOnesUnderDataParallelism) {
  auto sync = loom::test::scratch_dir("ck-sync"), async = loom::test::scratch_dir("ck-async");
  const std::string dp = " --set parallel.dp=2 --set parallel.zero=1 --set train.batch_size=4";
  ASSERT_EQ(run_loom("run -n 2 -- " LOOM_BINARY " " + train_args(sync, 6) + dp).rc, 0);
  auto r = run_loom("run -n 2 -- " LOOM_BINARY " " + train_args(async, 6) + dp + " --set checkpoint.async=true");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("checkpoint saved: " + (async / "ck" / "step-00000002").string() + " (written behind training)"),
            std::string::npos) << r.err;
  // Each rank's files of the sharded checkpoint, byte for byte.
  for (const char* step : {"step-00000002", "step-00000004", "step-00000006"})
    for (const char* file : {"model-rank00000.safetensors", "model-rank00001.safetensors",
                             "optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"}) {
      auto read = [&](const fs::path& root) {
        std::ifstream f(root / "ck" / step / file, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(f), {});
      };
      EXPECT_FALSE(read(async).empty()) << step << " " << file;
      EXPECT_TRUE(read(sync) == read(async)) << step << " " << file;
    }
  EXPECT_EQ(losses(sync), losses(async));
  EXPECT_EQ(latest(async), "step-00000006");
}

TEST(Checkpoint, ACorruptedByteIsDetectedAndNamesTheTensor) {
  auto root = loom::test::scratch_dir("ck-corrupt");
  ASSERT_EQ(run_loom(train_args(root, 2)).rc, 0);
  flip_byte(root / "ck" / "step-00000002" / "model.safetensors", 1000);
  auto r = run_loom(train_args(root, 4, "--resume"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("corrupted"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tensor '"), std::string::npos) << r.err;
  fs::remove_all(root);
}

// `loom ckpt inspect` (issue 18 item 4, for today's whole-tensor checkpoints): the step, model, saved
// layout and every tensor with its checksum verified; a flipped byte or a missing file is named and the
// exit status says so.
TEST(Checkpoint, InspectVerifiesEveryTensorAndNamesADamagedOne) {
  auto root = loom::test::scratch_dir("ck-inspect");
  ASSERT_EQ(run_loom(train_args(root, 2, "--set precision=bf16-sr")).rc, 0);
  auto r = run_loom("ckpt inspect " + (root / "ck").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("step 2 (optimizer steps 2)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model: tiny (gpt2: 2 layers, d_model 64"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("precision bf16-sr"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all 84 checksums verified"), std::string::npos) << r.out;
  r = run_loom("ckpt inspect --json " + (root / "ck" / "step-00000002").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["step"], 2);
  EXPECT_EQ(j["damaged"], 0);
  ASSERT_EQ(j["tensors"].size(), 84u);
  EXPECT_EQ(j["tensors"][0]["name"], "transformer.wte.weight");
  EXPECT_EQ(j["tensors"][0]["shape"], nlohmann::json::array({512, 64}));
  // One flipped byte near the end of the weights: the last tensor there is named, the rest still pass.
  flip_byte(root / "ck" / "step-00000002" / "model.safetensors", 100);
  r = run_loom("ckpt inspect --json " + (root / "ck").string());
  EXPECT_EQ(r.rc, 1);
  const auto k = nlohmann::json::parse(r.out);
  EXPECT_EQ(k["damaged"], 1);
  int mismatches = 0;
  for (const auto& t : k["tensors"]) mismatches += t["status"] == "checksum mismatch";
  EXPECT_EQ(mismatches, 1);
  fs::remove(root / "ck" / "step-00000002" / "optimizer.safetensors");
  r = run_loom("ckpt inspect " + (root / "ck").string());
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("optimizer.safetensors: cannot be read"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("57 of 84 tensors DAMAGED or missing"), std::string::npos) << r.out;
  r = run_loom("ckpt inspect " + (root / "nothing").string());
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("no checkpoint at"), std::string::npos) << r.err;
  fs::remove_all(root);
}

TEST(Checkpoint, KeepPrunesOnlyThisRunsOlderCheckpoints) {
  auto root = loom::test::scratch_dir("ck-keep");
  // Another run's checkpoint shares the folder (as after a user copied it in to resume from).
  ASSERT_EQ(run_loom(train_args(root, 2)).rc, 0);
  fs::rename(root / "ck" / "step-00000002", root / "foreign");
  fs::remove(root / "ck" / "latest");
  auto other = loom::test::scratch_dir("ck-keep-other");
  ASSERT_EQ(run_loom(train_args(other, 2)).rc, 0);
  fs::rename(other / "ck" / "step-00000002", root / "ck" / "step-00000001");  // foreign run_id
  fs::remove_all(other);
  auto refused = run_loom(train_args(root, 8, "--keep 2"));
  EXPECT_EQ(refused.rc, 1);
  EXPECT_NE(refused.err.find("another run"), std::string::npos) << refused.err;
  fs::rename(root / "foreign", root / "ck" / "step-00000002");
  std::ofstream(root / "ck" / "latest") << "step-00000002\n";
  auto r = run_loom(train_args(root, 8, "--resume --keep 2"));
  ASSERT_EQ(r.rc, 0) << r.err;
  std::vector<std::string> left;
  for (auto& e : fs::directory_iterator(root / "ck"))
    if (e.path().filename().string().rfind("step-", 0) == 0) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"step-00000001", "step-00000006", "step-00000008"}));
  fs::remove_all(root);
}

TEST(Checkpoint, SigtermSavesAtTheNextStepBoundaryAndSaysSoExactly) {
  auto root = loom::test::scratch_dir("ck-term");
  const std::string err_file = (root / "err.txt").string(), json_file = (root / "summary.json").string();
  std::string cmd = std::string(LOOM_BINARY) + " " + train_args(root, 100000, "--json", 0) + " >" + json_file + " 2>" +
                    err_file + " & pid=$!; for i in $(seq 600); do grep -q \"step \" " + err_file +
                    " && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo rc=$?";
  FILE* p = ::popen(("bash -c '" + cmd + "'").c_str(), "r");
  char buf[256] = {0};
  std::string out;
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ::pclose(p);
  // 128 + SIGTERM: what torchrun-style agents read as "preempted", distinct from finished (0) and failed (1).
  EXPECT_NE(out.find("rc=143"), std::string::npos) << "[" << out << "] " << cmd;
  std::ifstream e(err_file);
  std::string err((std::istreambuf_iterator<char>(e)), {});
  std::string name = latest(root);
  ASSERT_FALSE(name.empty()) << err;
  EXPECT_TRUE(fs::exists(root / "ck" / name / "manifest.json"));
  const int saved = std::stoi(name.substr(5));
  EXPECT_NE(err.find("stopped by SIGTERM after step " + std::to_string(saved) + " of 100000, saved as step " +
                     std::to_string(saved)),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("stopped: step " + std::to_string(saved) + " | loss"), std::string::npos) << err;
  // --json describes the step that ran last and was saved, with the loss that step logged.
  std::ifstream j(json_file);
  auto summary = nlohmann::json::parse(j);
  EXPECT_EQ(summary["stopped_by"], "SIGTERM");
  EXPECT_EQ(summary["last_step"].get<int>(), saved);
  EXPECT_EQ(summary["saved_step"].get<int>(), saved);
  const auto logged = losses(root);
  ASSERT_EQ(static_cast<int>(logged.size()), saved);
  EXPECT_DOUBLE_EQ(summary["final_loss"].get<double>(), logged.back());
  fs::remove_all(root);
}

TEST(Checkpoint, AFinishedRunSaysItWasNotStopped) {
  auto root = loom::test::scratch_dir("ck-done");
  auto r = run_loom(train_args(root, 3, "--json"));
  ASSERT_EQ(r.rc, 0) << r.err;
  auto summary = nlohmann::json::parse(r.out);
  EXPECT_TRUE(summary["stopped_by"].is_null());
  EXPECT_EQ(summary["last_step"].get<int>(), 3);
  EXPECT_DOUBLE_EQ(summary["final_loss"].get<double>(), losses(root).back());
  fs::remove_all(root);
}

TEST(Checkpoint, ResumingADifferentModelIsRefused) {
  auto root = loom::test::scratch_dir("ck-model");
  ASSERT_EQ(run_loom(train_args(root, 2)).rc, 0);
  auto r = run_loom(train_args(root, 4, "--resume --set model.n_layers=3"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("model.n_layers"), std::string::npos) << r.err;
  fs::remove_all(root);
}
