// Multi-rank tests of the collectives library: each starts a job of comm_worker ranks through the
// launcher (`loom run`) or mpirun and checks exit codes, messages, and that nothing is left in /dev/shm.
// The numerical checks themselves (op x dtype x size x in-place x algorithm against a float64
// reference, bitwise-identical results across ranks) run inside comm_worker.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../cli/cli_runner.h"

namespace {

using loom::test::CliResult;
using loom::test::run_shell;

const std::string kWorker = LOOM_COMM_WORKER;
const std::string kLoom = LOOM_BINARY;
// Root may run mpirun only with --allow-run-as-root; 8 ranks on 2 cores need --oversubscribe.
const std::string kMpirun = "mpirun --allow-run-as-root --oversubscribe --bind-to none";

std::string unique_job_id(const std::string& what) {
  static int counter = 0;
  return "t" + std::to_string(::getpid()) + "-" + what + "-" + std::to_string(counter++);
}

int leftover_segments(const std::string& job_id) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
    if (e.path().filename().string().rfind("loom-" + job_id + "-", 0) == 0) ++n;
  return n;
}

struct Launched {
  CliResult result;
  double seconds = 0;
  std::string job_id;
};

// `loom run -n N` of one comm_worker scenario, with a job id of its own so leftovers can be checked.
Launched loom_run(int ranks, const std::string& scenario, const std::string& env = "") {
  Launched l;
  l.job_id = unique_job_id(scenario);
  const auto t0 = std::chrono::steady_clock::now();
  l.result = run_shell("LOOM_JOB_ID=" + l.job_id + " " + env + " exec " + kLoom + " run -n " + std::to_string(ranks) +
                       " -- " + kWorker + " " + scenario);
  l.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return l;
}

Launched mpi_run(int ranks, const std::string& scenario, const std::string& env_flags) {
  Launched l;
  l.job_id = unique_job_id(scenario);
  // A watchdog well inside ctest's timeout: a hang reports which op and which ranks instead of a bare kill.
  l.result = run_shell("exec " + kMpirun + " -np " + std::to_string(ranks) + " -x LOOM_COMM_TIMEOUT=120" +
                       " -x LOOM_JOB_ID=" + l.job_id + " " +
                       env_flags + " " + kWorker + " " + scenario);
  return l;
}

// The `#wrong` column of every result row of `loom bench comm` output, with the row.
std::vector<std::pair<std::string, std::string>> wrong_counts(const std::string& out) {
  std::vector<std::pair<std::string, std::string>> rows;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#' || line.find("size(B)") != std::string::npos) continue;
    std::istringstream f(line);
    std::string col[8];
    for (auto& c : col) f >> c;
    rows.emplace_back(col[7], line);
  }
  return rows;
}

class SharedMemoryMatrix : public ::testing::TestWithParam<int> {};

TEST_P(SharedMemoryMatrix, EveryOpDtypeSizeAndAlgorithmMatchesTheReference) {
  auto l = loom_run(GetParam(), "matrix");
  EXPECT_EQ(l.result.rc, 0) << l.result.out << l.result.err;
  EXPECT_NE(l.result.out.find("matrix ok on shm"), std::string::npos) << l.result.out;
  EXPECT_EQ(leftover_segments(l.job_id), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, SharedMemoryMatrix, ::testing::Values(1, 2, 3, 4, 8));

class MpiMatrix : public ::testing::TestWithParam<int> {};

TEST_P(MpiMatrix, EveryOpDtypeSizeAndAlgorithmMatchesTheReference) {
  auto l = mpi_run(GetParam(), "matrix", "-x LOOM_COMM=mpi");
  EXPECT_EQ(l.result.rc, 0) << l.result.out << l.result.err;
  EXPECT_NE(l.result.out.find("matrix ok on mpi"), std::string::npos) << l.result.out;
}

INSTANTIATE_TEST_SUITE_P(Ranks, MpiMatrix, ::testing::Values(1, 2, 3, 4, 8));

TEST(Collectives, TwoSubgroupsRunAtOnce) {
  auto l = loom_run(4, "subgroups");
  EXPECT_EQ(l.result.rc, 0) << l.result.out << l.result.err;
  EXPECT_NE(l.result.out.find("subgroups ok"), std::string::npos);
}

TEST(Collectives, AsyncOpsCompleteInIssueOrder) {
  auto l = loom_run(3, "async");
  EXPECT_EQ(l.result.rc, 0) << l.result.out << l.result.err;
  EXPECT_NE(l.result.out.find("async ok"), std::string::npos);
}

TEST(Collectives, FourRanksAsTwoNodesGoHierarchicalAndMpiCarriesTheInterNodeBytes) {
  // comm_worker fails when the inter-node transport carried nothing.
  auto l = mpi_run(4, "hier", "-x LOOM_RANKS_PER_NODE=2");
  EXPECT_EQ(l.result.rc, 0) << l.result.out << l.result.err;
  EXPECT_NE(l.result.out.find("hier ok on shm+mpi over 2 nodes"), std::string::npos) << l.result.out;
  EXPECT_EQ(leftover_segments(l.job_id), 0);
}

TEST(Collectives, ARankThatNeverJoinsFailsTheOthersWithinTheDeadline) {
  auto l = loom_run(2, "never_join", "LOOM_COMM_TIMEOUT=3");
  EXPECT_NE(l.result.rc, 0);
  EXPECT_NE(l.result.err.find("rank(s) 1"), std::string::npos) << l.result.err;
  EXPECT_NE(l.result.err.find("LOOM_COMM_TIMEOUT"), std::string::npos) << l.result.err;
  EXPECT_NE(l.result.err.find("loom run: rank 0"), std::string::npos) << l.result.err;
  // Deadline + 1 s, plus the launch itself (process start-up, a few hundred ms on a loaded machine).
  EXPECT_LT(l.seconds, 3.0 + 1.0 + 1.0);
  EXPECT_EQ(leftover_segments(l.job_id), 0);
}

TEST(Collectives, DebugModeNamesTheRankWhoseOpDisagrees) {
  auto l = loom_run(3, "mismatch", "LOOM_COMM_DEBUG=1 LOOM_COMM_TIMEOUT=20");
  EXPECT_NE(l.result.rc, 0);
  // The always-on check may notice before debug mode does: then rank 1 names its own op (as in
  // MismatchedOpsFailFastWithoutDebugMode).
  EXPECT_TRUE(l.result.err.find("rank 1 called all_gather") != std::string::npos ||
              (l.result.err.find("rank 1: ops disagree in group world: rank ") != std::string::npos &&
               l.result.err.find("this rank called all_gather") != std::string::npos))
      << l.result.err;
  EXPECT_LT(l.seconds, 15.0) << "the mismatch must be reported, not time out";
}

// The always-on check (no LOOM_COMM_DEBUG): every record and message carries its op's descriptor, so
// ranks in different ops, or the same op with different counts, fail at the first contact with the
// names debug mode gives. On main these waited for LOOM_COMM_TIMEOUT.
TEST(Collectives, MismatchedOpsFailFastWithoutDebugMode) {
  for (const char* scenario : {"mismatch", "count_mismatch_small", "count_mismatch_large"}) {
    SCOPED_TRACE(scenario);
    auto l = loom_run(3, scenario, "LOOM_COMM_TIMEOUT=60");
    EXPECT_NE(l.result.rc, 0);
    EXPECT_NE(l.result.err.find("ops disagree in group world"), std::string::npos) << l.result.err;
    // Whichever side notices first names the other: a rank names rank 1's op, or rank 1 names its own.
    const std::string theirs = std::string(scenario) == "mismatch" ? "all_gather(F32, 64 elements) #1"
                                                                   : "all_reduce(F32, sum, ";
    EXPECT_TRUE(l.result.err.find("rank 1 called " + theirs) != std::string::npos ||
                (l.result.err.find("rank 1: ops disagree in group world: rank ") != std::string::npos &&
                 l.result.err.find("this rank called " + theirs) != std::string::npos))
        << l.result.err;
    EXPECT_LT(l.seconds, 10.0) << "the mismatch must be reported, not time out";
    EXPECT_EQ(leftover_segments(l.job_id), 0);
  }
}

TEST(Collectives, AKilledRankBringsTheJobDownWithTheLaunchersReport) {
  auto l = loom_run(3, "crash", "LOOM_COMM_TIMEOUT=60");
  EXPECT_EQ(l.result.rc, 1);
  EXPECT_NE(l.result.err.find("rank 1 (pid"), std::string::npos) << l.result.err;
  EXPECT_NE(l.result.err.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << l.result.err;
  EXPECT_NE(l.result.err.find("job failed"), std::string::npos) << l.result.err;
  EXPECT_LT(l.seconds, 15.0) << "the other ranks must be stopped, not left waiting for the watchdog";
  EXPECT_EQ(leftover_segments(l.job_id), 0);
}

TEST(BenchComm, RunsEveryOpAndFindsNoWrongElements) {
  const std::string id = unique_job_id("bench");
  auto r = run_shell("LOOM_JOB_ID=" + id + " exec " + kLoom + " run -n 2 -- " + kLoom +
                     " bench comm -b 4 -e 1M -f 64 --batches 1 --batch-seconds 0.002");
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  const auto rows = wrong_counts(r.out);
  for (const auto& [wrong, line] : rows) EXPECT_EQ(wrong, "0") << line;
  // Sizes 4 B, 256 B, 16 KiB, 1 MiB for six ops; at 4 B the ops that split the buffer over 2 ranks have no
  // whole f32 per rank and are skipped (reduce_scatter, all_gather, all_to_all).
  EXPECT_EQ(rows.size(), 6u * 4 - 3) << r.out;
  EXPECT_EQ(leftover_segments(id), 0);
}

// Registered buffers used in place are the case where peers read memory its owner is overwriting (an
// in-place all_to_all once returned wrong blocks there); the bench checks every result element.
TEST(BenchComm, InPlaceOnRegisteredBuffersFindsNoWrongElements) {
  for (const char* dtype : {"f32", "bf16"}) {
    auto r = run_shell("exec " + kLoom + " run -n 3 -- " + kLoom + " bench comm --inplace --dtype " + dtype +
                       " -b 64 -e 4M -f 16 --batches 1 --batch-seconds 0.002 --no-ceiling");
    ASSERT_EQ(r.rc, 0) << r.out << r.err;
    const auto rows = wrong_counts(r.out);
    for (const auto& [wrong, line] : rows) EXPECT_EQ(wrong, "0") << dtype << ": " << line;
    EXPECT_GE(rows.size(), 6u * 4) << r.out;
  }
}

// --busy-ms times each op alone between GEMMs (as a step issues its collectives): the results are still
// checked, and a op's time is at least what it takes between idle ranks' batches, never zero.
TEST(BenchComm, BetweenBusyWorkTimesEveryOpAndFindsNoWrongElements) {
  auto r = run_shell("exec " + kLoom + " run -n 2 -- " + kLoom +
                     " bench comm --ops all_reduce,all_gather -b 1K -e 64K -f 64 --batches 2 --batch-seconds 0.01"
                     " --busy-ms 1 --plain --no-ceiling --json");
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  int rows = 0;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    ++rows;
    EXPECT_NE(line.find("\"wrong\":0"), std::string::npos) << line;
    const auto at = line.find("\"time_us\":");
    ASSERT_NE(at, std::string::npos) << line;
    EXPECT_GT(std::stod(line.substr(at + 10)), 0.0) << line;
  }
  EXPECT_EQ(rows, 4) << r.out;  // two ops x 1 KiB, 64 KiB
  auto bad = run_shell("exec " + kLoom + " bench comm --busy-ms -1");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find("--busy-ms"), std::string::npos) << bad.err;
}

TEST(BenchComm, VsMpiOutsideMpirunIsAClearError) {
  auto r = run_shell("exec " + kLoom + " bench comm --vs mpi -e 4K");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("start it with mpirun"), std::string::npos) << r.err;
}

}  // namespace
