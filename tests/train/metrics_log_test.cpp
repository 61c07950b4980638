// The metrics log across a restart: resuming from the checkpoint of step S drops the lines of later
// steps (a crashed attempt logged them; they run again), a line cut short by the crash, and never glues
// the next record onto a last line that lost its newline.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "loom/core/file_reader.h"
#include "loom/train/run_log.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir() {
  auto d = fs::temp_directory_path() / ("loom-metrics-log-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<int64_t> steps_in(const fs::path& file) {
  std::vector<int64_t> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  return out;
}

TEST(MetricsLog, ResumingDropsTheStepsThatRunAgainAndAnyCutLine) {
  const auto dir = fresh_dir();
  const auto file = dir / "metrics.jsonl";
  const std::string one = "{\"step\": 1, \"loss\": 3.0}\n", two = "{\"step\": 2, \"loss\": 2.0}";
  // Later steps to drop; a line cut short; the checkpoint's own step without its newline.
  for (const std::string text : {one + two + "\n{\"step\": 3, \"loss\": 1.5}\n{\"step\": 4, \"loss\": 1.2}\n",
                                 one + two + "\n{\"step\": 3, \"lo", one + two}) {
    SCOPED_TRACE(text);
    std::ofstream(file) << text;
    {
      MetricsLog log(dir.string(), /*append=*/true);
      log.drop_after(2);
      StepMetrics s;
      s.step = 3, s.loss = 1.5;
      log.write(s);
    }
    const std::string after = read_file(file);
    ASSERT_FALSE(after.empty());
    EXPECT_EQ(after.back(), '\n');
    EXPECT_EQ(steps_in(file), (std::vector<int64_t>{1, 2, 3})) << after;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom::train

namespace loom::train {
namespace {

// Each new run in a folder keeps the earlier log beside its own, named by when it was last written
// (UTC, readable) -- every one of them, even when several runs end within the same second.
TEST(MetricsLog, EveryEarlierRunsLogIsKeptUnderADatedName) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("loom-metrics-kept-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  for (int run = 0; run < 4; ++run) {
    MetricsLog log(dir.string(), /*append=*/false);
    StepMetrics m;
    m.step = run + 1;
    log.write(m);
  }
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string() != "metrics.jsonl") kept.push_back(e.path().filename().string());
  ASSERT_EQ(kept.size(), 3u);
  for (const auto& name : kept) {
    // metrics-YYYYmmdd-HHMMSS[-n].jsonl, of this century
    EXPECT_EQ(name.rfind("metrics-20", 0), 0u) << name;
    EXPECT_EQ(name[16], '-') << name;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom::train
