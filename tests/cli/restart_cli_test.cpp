// Jobs that survive a dead rank (`loom run --max-restarts K`): a random rank is SIGKILLed at a random
// step three times during a 2-rank training run; the launcher restarts the job each time from the
// newest complete checkpoint, and the final weights and optimizer state are bitwise those of the same
// run left alone. After every kill, the checkpoint `latest` points at is whole (`loom ckpt inspect`
// verifies every tensor's checksum), and at the end every step folder is.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <set>
#include <thread>

#include "checkpoint_tensors.h"
#include "cli_runner.h"
#include "run_metrics.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kTiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml ";
constexpr int kSteps = 16;

std::string train_args(const fs::path& dir) {
  return "loom train " + kTiny + "--quiet --set parallel.dp=2 --set train.steps=" + std::to_string(kSteps) +
         " --set train.batch_size=8 --set train.seq_len=32 --set train.eval_every=0 --set trace.summary=false"
         " --set checkpoint.save_every=2 --set train.out_dir=" + (dir / "out").string() +
         " --set checkpoint.dir=" + (dir / "ckpt").string();
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The processes whose parent is `pid`, with their LOOM_RANK.
std::vector<std::pair<pid_t, int>> ranks_of(pid_t launcher) {
  std::vector<std::pair<pid_t, int>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != launcher || state == 'Z') continue;
    const std::string env = read_file(e.path() / "environ");
    const auto at = env.find(std::string("LOOM_RANK=") );
    if (at == std::string::npos) continue;
    out.push_back({static_cast<pid_t>(std::stol(name)), std::stoi(env.substr(at + 10))});
  }
  return out;
}

// The last step rank 0 logged (0 before the first): its whole lines, one per step (a line being
// written is not counted).
int64_t last_logged_step(const fs::path& out) {
  const std::string text = read_file(out / "metrics.jsonl");
  return static_cast<int64_t>(std::count(text.begin(), text.end(), '\n'));
}

TEST(RestartCli, ThreeRandomRankDeathsLeaveTheFinalStateOfAnUninterruptedRun) {
  auto ref = scratch_dir("restart-ref"), faulted = scratch_dir("restart-faulted");
  // Slow steps (a test-only data-loader delay) give the test time to kill inside a step or a save.
  const std::string slow = "LOOM_FAULT_INJECT=slow_data:40 ";
  auto r = run_shell(slow + "exec " LOOM_BINARY " run -n 2 -- " + train_args(ref));
  ASSERT_EQ(r.rc, 0) << r.err;

  const unsigned seed = static_cast<unsigned>(std::random_device{}());
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  // Steps after which to kill: each past the previous restart's checkpoint (save_every = 2) and its
  // re-run steps, all before the end.
  std::vector<int64_t> at{2 + static_cast<int64_t>(rng() % 3)};
  for (int i = 1; i < 3; ++i) at.push_back(at.back() + 3 + static_cast<int64_t>(rng() % 2));

  const std::string err = (faulted / "launcher.err").string();
  const std::string cmd = slow + "exec " LOOM_BINARY " run -n 2 --max-restarts 3 -- " + train_args(faulted) +
                          " 2>" + err;
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  std::set<pid_t> killed;
  std::string story;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (size_t k = 0; k < at.size(); ++k) {
    // Wait for an attempt none of whose ranks was killed, past the step.
    std::vector<std::pair<pid_t, int>> ranks;
    for (;;) {
      ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "no attempt reached step " << at[k] << story;
      ranks = ranks_of(launcher);
      bool fresh = ranks.size() == 2;
      for (auto& [pid, rank] : ranks) fresh = fresh && !killed.count(pid);
      if (fresh && last_logged_step(faulted / "out") >= at[k]) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const auto victim = ranks[rng() % ranks.size()];
    ::kill(victim.first, SIGKILL);
    killed.insert(victim.first);
    story += "; killed rank " + std::to_string(victim.second) + " after step " + std::to_string(at[k]);
    // Once the attempt is gone (both its ranks), `latest` must name a whole checkpoint.
    for (;;) {
      ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "the killed attempt did not end" << story;
      auto now = ranks_of(launcher);
      bool old = false;
      for (auto& [pid, rank] : now)
        for (auto& [p, rk] : ranks) old = old || pid == p;
      if (!old) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (fs::exists(faulted / "ckpt" / "latest")) {
      auto inspect = run_loom("ckpt inspect " + (faulted / "ckpt").string());
      EXPECT_EQ(inspect.rc, 0) << inspect.out << inspect.err << story;
    }
  }
  int status = 0;
  ASSERT_EQ(::waitpid(launcher, &status, 0), launcher);
  const std::string log = read_file(err);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log << story;
  // Each restart is logged with the rank that died and how.
  std::istringstream lines(log);
  int restarts = 0;
  for (std::string line; std::getline(lines, line);)
    if (line.find("restarting the job (restart") != std::string::npos) {
      ++restarts;
      EXPECT_THAT(line, HasSubstr("was killed by signal 9 (SIGKILL)")) << "the cause is the rank that died";
    }
  EXPECT_EQ(restarts, 3) << log;

  // Bitwise the uninterrupted run's final state, and a metrics log with every step once.
  const auto final_dir = [](const fs::path& d) {
    char name[32];
    std::snprintf(name, sizeof name, "step-%08d", kSteps);
    return d / "ckpt" / name;
  };
  for (auto role : {loom::train::TensorRole::Weight, loom::train::TensorRole::ExpAvg, loom::train::TensorRole::ExpAvgSq})
    EXPECT_TRUE(checkpoint_tensors(final_dir(ref), role) == checkpoint_tensors(final_dir(faulted), role))
        << loom::train::role_name(role) << story;
  EXPECT_EQ(losses(faulted / "out"), losses(ref / "out")) << story;
  for (const auto& e : fs::directory_iterator(faulted / "ckpt")) {
    const std::string name = e.path().filename().string();
    EXPECT_EQ(name.rfind(".tmp-", 0), std::string::npos) << "a half-written save was left: " << name;
    if (name.rfind("step-", 0) == 0) {
      auto inspect = run_loom("ckpt inspect " + e.path().string());
      EXPECT_EQ(inspect.rc, 0) << name << ": " << inspect.out << inspect.err;
    }
  }
}

TEST(RestartCli, AFailureBeyondTheRestartsFailsTheJobAndAStopIsNeverRestarted) {
  // A command that always fails: K restarts, each logged, then the job fails naming the cause.
  auto r = run_loom("run -n 2 --max-restarts 2 -- sh -c \"exit 3\"");
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(count(r.err, "restarting the job (restart"), 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("job failed after 2 restart(s): rank"));
  EXPECT_THAT(r.err, HasSubstr("exited with status 3"));
  // Ranks see which attempt they are.
  r = run_loom("run -n 1 --max-restarts 1 -- sh -c \"echo attempt \\$LOOM_RESTART_COUNT >&2; exit \\$((1 - LOOM_RESTART_COUNT))\"");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("attempt 0"));
  EXPECT_THAT(r.err, HasSubstr("attempt 1"));
  // A rank that stops when asked (128 + SIGTERM) is not a failure: no restart.
  r = run_loom("run -n 1 --max-restarts 3 -- sh -c \"exit 143\"");
  EXPECT_EQ(r.rc, 143);
  EXPECT_EQ(count(r.err, "restarting"), 0) << r.err;
  // Bad values and multi-node restarts are refused before anything starts.
  r = run_loom("run -n 2 --max-restarts -1 -- true");
  EXPECT_NE(r.rc, 0);
  r = run_loom("run -n 1 --nnodes 2 --master-port 29999 --max-restarts 1 -- true", "LOOM_JOB_SECRET=x");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("--max-restarts needs a one-node job"));
}

}  // namespace
}  // namespace loom::test
