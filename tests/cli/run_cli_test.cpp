// `loom run`, the launcher: variables it gives each rank, failure reports, Ctrl-C, bad flags.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli_runner.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;

TEST(RunCli, EachRankGetsTorchrunStyleVariables) {
  auto r = run_loom(
      "run -n 3 -- sh -c \"echo rank=\\$LOOM_RANK local=\\$LOOM_LOCAL_RANK world=\\$LOOM_WORLD_SIZE "
      "lws=\\$LOOM_LOCAL_WORLD_SIZE addr=\\$LOOM_MASTER_ADDR port=\\$LOOM_MASTER_PORT secret=\\${#LOOM_JOB_SECRET}\"");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int k = 0; k < 3; ++k)
    EXPECT_THAT(r.out, HasSubstr("rank=" + std::to_string(k) + " local=" + std::to_string(k) + " world=3 lws=3 addr=127.0.0.1"));
  EXPECT_THAT(r.out, HasSubstr("secret=64"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("port=0")));
}

TEST(RunCli, MultiNodeRanksAreNumberedByNode) {
  auto r = run_loom("run -n 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 1 -- sh -c \"echo "
                    "r=\\$LOOM_RANK\"",
                    "LOOM_JOB_SECRET=s3cret");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("r=2"));
  EXPECT_THAT(r.out, HasSubstr("r=3"));
}

TEST(RunCli, AFailingRankStopsTheOthersAndIsNamed) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_loom("run -n 3 -- sh -c \"if [ \\$LOOM_RANK = 2 ]; then exit 7; fi; exec sleep 60\"");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("rank 2 (pid"));
  EXPECT_THAT(r.err, HasSubstr("exited with status 7"));
  EXPECT_THAT(r.err, HasSubstr("stopping the other 2 rank(s)"));
  EXPECT_LT(s, 10.0);
}

TEST(RunCli, ARankKilledByASignalIsReportedWithTheSignalName) {
  auto r = run_loom("run -n 2 -- sh -c \"if [ \\$LOOM_RANK = 1 ]; then kill -SEGV \\$\\$; fi; exec sleep 60\"");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid"));
  EXPECT_THAT(r.err, HasSubstr("killed by signal 11 (SIGSEGV)"));
}

TEST(RunCli, RanksThatIgnoreSigtermAreKilledAfterTheGracePeriod) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_loom("run -n 2 --kill-grace 1 -- sh -c \"trap : TERM; if [ \\$LOOM_RANK = 0 ]; then sleep 0.5; exit 3; fi; "
                    "while true; do sleep 0.1; done\"");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("killing them")) << r.out;
  EXPECT_LT(s, 8.0);
}

TEST(RunCli, CtrlCStopsTheWholeJob) {
  // The launcher runs in the background of a shell that sends it SIGINT as a terminal would.
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_shell(std::string(LOOM_BINARY) + " run -n 2 -- sleep 60 & pid=$!; sleep 0.5; kill -INT $pid; wait $pid");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.rc, 130) << r.err;
  EXPECT_THAT(r.err, HasSubstr("received SIGINT"));
  EXPECT_LT(s, 10.0);
}

TEST(RunCli, SuccessIsZeroAndLoomMeansThisBinary) {
  auto r = run_loom("run -n 2 -- loom --version");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("loom "));
}

TEST(RunCli, BadInvocationsAreClearErrors) {
  auto r = run_loom("run -n 0 -- true");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("-n 0"));
  r = run_loom("run -n 2 --nnodes 2 -- true", "unset LOOM_JOB_SECRET;");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("LOOM_JOB_SECRET"));
  r = run_loom("run -n 2 --nnodes 2 --node-rank 2 -- true", "LOOM_JOB_SECRET=x");
  EXPECT_THAT(r.err, HasSubstr("--node-rank 2"));
  r = run_loom("run -n 2 --nnodes 2 --node-rank 1 --master-port 29500 -- true", "LOOM_JOB_SECRET=x");
  EXPECT_THAT(r.err, HasSubstr("--master-addr"));
  r = run_loom("run -n 1 -- /nonexistent/program");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot start '/nonexistent/program'"));
}


// Ranks blocked in a collective notice that the peer they wait for is gone (its lock on a shared-memory
// object drops with the process), so the job is down in well under a second; on main they sat in the
// collective until the launcher's kill grace (3 s) ran out.
TEST(RunCli, AKilledRankBringsATrainingJobDownWithinASecond) {
  const std::filesystem::path dir = scratch_dir("killed");
  const std::string d = dir.string();
  auto r = run_shell(std::string(LOOM_BINARY) + " run -n 3 -- " + LOOM_BINARY + " train --config " LOOM_SOURCE_DIR
                     "/configs/tiny.toml --set parallel.dp=3 --set train.batch_size=6 --set train.steps=1000000 "
                     "--set train.out_dir=" + d + "/out -q > " + d + "/log 2>&1 & pid=$!; "
                     "for i in $(seq 600); do [ -f " + d + "/out/metrics.jsonl ] && [ $(wc -l < " + d +
                     "/out/metrics.jsonl) -ge 3 ] && break; sleep 0.05; done; "
                     "child=$(pgrep -P $pid | sed -n 2p); t0=$(date +%s%N); kill -KILL $child; wait $pid; rc=$?; "
                     "t1=$(date +%s%N); echo \"rc=$rc ms=$(( (t1 - t0) / 1000000 ))\"");
  std::ifstream in(dir / "log");
  const std::string log((std::istreambuf_iterator<char>(in)), {});
  EXPECT_THAT(r.out, HasSubstr("rc=1 ")) << r.out << log;
  const auto at = r.out.find("ms=");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_LE(std::stoi(r.out.substr(at + 3)), 1000) << log;
  EXPECT_THAT(log, HasSubstr("killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(log, HasSubstr("is gone (its process exited)"));
  std::filesystem::remove_all(dir);
}

// A local user can list /dev/shm and read every process's command line; the job's log is often
// shared. None of them may hold any piece of the job secret, whatever characters it has.
TEST(RunCli, TheJobSecretAppearsInNoFileNameCommandLineOrLog) {
  namespace fs = std::filesystem;
  const fs::path dir = scratch_dir("secret");
  // Spaces and slashes broke the job on main (the id was the secret's first 12 characters).
  const std::string secret = "Qv7 zK/w9+Jm xR4-pL8 T3sq";
  { std::ofstream(dir / "secret") << secret; }
  const std::string d = dir.string();
  auto r = run_shell("export LOOM_JOB_SECRET=\"$(cat " + d + "/secret)\"; " + std::string(LOOM_BINARY) +
                     " run -n 2 -- " + LOOM_BINARY + " train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set parallel.dp=2"
                     " --set train.steps=40 --set train.out_dir=" + d + "/out --save-dir " + d + "/ck --save-every 20 > " + d +
                     "/log 2>&1 & pid=$!; "
                     "while kill -0 $pid 2>/dev/null; do ls -la /dev/shm >> " + d + "/shm; "
                     "cat /proc/[0-9]*/cmdline 2>/dev/null | tr \"\\0\" \" \" >> " + d + "/cmdline; sleep 0.01; done; wait $pid");
  auto slurp = [&](const std::string& name) {
    std::ifstream in(dir / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string log = slurp("log");
  ASSERT_EQ(r.rc, 0) << log;
  std::string everything = log + slurp("shm") + slurp("cmdline") + slurp("out/metrics.jsonl") + slurp("out/manifest.json");
  for (const auto& e : fs::recursive_directory_iterator(dir / "ck"))
    if (e.is_regular_file() && e.path().extension() == ".json") everything += slurp(fs::relative(e.path(), dir).string());
  EXPECT_GT(slurp("cmdline").size(), 0u);
  // No run of 4 characters of the secret anywhere.
  for (size_t i = 0; i + 4 <= secret.size(); ++i)
    EXPECT_EQ(everything.find(secret.substr(i, 4)), std::string::npos) << "'" << secret.substr(i, 4) << "' leaked";
  // Whatever Loom left visible under /dev/shm was private to the user.
  std::istringstream shm(slurp("shm"));
  for (std::string line; std::getline(shm, line);)
    if (line.find(" loom-") != std::string::npos) EXPECT_EQ(line.rfind("-rw-------", 0), 0u) << line;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom::test
