// `loom run`, the launcher: variables it gives each rank, failure reports, Ctrl-C, bad flags.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
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

}  // namespace
}  // namespace loom::test
