#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "loom/error.h"
#include "loom/profile/tracer.h"

using namespace loom;
using namespace loom::profile;

TEST(Tracer, OffModeRecordsNothing) {
  Tracer t(Tracer::Mode::Off);
  { Span s(&t, "gemm_fwd", Category::Gemm, 1e9, 1e6); }
  { Span s(nullptr, "no tracer", Category::Kernel); }
  EXPECT_TRUE(t.stats().empty());
  EXPECT_EQ(t.event_count(), 0u);
}

TEST(Tracer, SummaryAggregatesCallsTimeFlopsAndBytesPerName) {
  Tracer t(Tracer::Mode::Summary);
  for (int i = 0; i < 3; ++i) {
    Span s(&t, "gemm_fwd", Category::Gemm, 2e6, 3e3);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto st = t.stats().at("gemm_fwd");
  EXPECT_EQ(st.calls, 3);
  EXPECT_DOUBLE_EQ(st.flops, 6e6);
  EXPECT_DOUBLE_EQ(st.bytes, 9e3);
  EXPECT_GE(st.seconds, 0.006);
  EXPECT_EQ(t.event_count(), 0u);  // summary keeps no events
  t.reset_stats();
  EXPECT_TRUE(t.stats().empty());
}

TEST(Tracer, BreakdownSplitsWallTimeIntoGemmKernelsAndHost) {
  Tracer t(Tracer::Mode::Summary);
  t.record("gemm_fwd", Category::Gemm, 0, 600'000'000, 1, 1);
  t.record("layernorm_fwd", Category::Kernel, 0, 300'000'000, 1, 1);
  t.record("step", Category::Step, 0, 1'000'000'000, 0, 0);
  auto b = breakdown(t, 1.0);
  EXPECT_NEAR(b.gemm_seconds, 0.6, 1e-12);
  EXPECT_NEAR(b.kernel_seconds, 0.3, 1e-12);
  EXPECT_NEAR(b.host_seconds, 0.1, 1e-9);
  ASSERT_EQ(b.rows.size(), 2u);
  EXPECT_EQ(b.rows[0].first, "gemm_fwd");  // sorted by time
  EXPECT_NE(format_breakdown(b).find("host 10.0%"), std::string::npos) << format_breakdown(b);
}

TEST(Tracer, ChromeTraceIsValidJsonWithCompleteEvents) {
  Tracer t(Tracer::Mode::Full, 3);
  { Span s(&t, "attention_fwd", Category::Kernel, 5e8, 1e6); }
  { Span s(&t, "step", Category::Step); }
  auto path = std::filesystem::temp_directory_path() / ("loom-trace-" + std::to_string(::getpid()) + ".json");
  t.write_chrome_trace(path.string());
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in);
  int complete = 0;
  for (auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_EQ(e["pid"], 3);
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(complete, 2);
  std::filesystem::remove(path);
  EXPECT_THROW(t.write_chrome_trace("/nonexistent-dir/x.json"), IoError);
}

// The check a traced run makes before its first step: folders are made, an existing trace is left as
// it is, and a path that cannot hold a file is refused.
TEST(Tracer, PrepareTraceFileMakesTheFolderAndRefusesPathsThatCannotBeWritten) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("loom-trace-prep-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  Tracer::prepare_trace_file((dir / "a" / "b" / "trace.json").string());
  EXPECT_TRUE(fs::is_directory(dir / "a" / "b"));
  EXPECT_FALSE(fs::exists(dir / "a" / "b" / "trace.json"));  // nothing created or truncated
  std::ofstream(dir / "old.json") << "kept";
  Tracer::prepare_trace_file((dir / "old.json").string());
  std::ifstream old(dir / "old.json");
  std::string kept;
  old >> kept;
  EXPECT_EQ(kept, "kept");
  EXPECT_THROW(Tracer::prepare_trace_file((dir / "old.json" / "x.json").string()), IoError);
  EXPECT_THROW(Tracer::prepare_trace_file(dir.string()), IoError);
  EXPECT_THROW(Tracer::prepare_trace_file((dir / "a" / "").string()), IoError);
  fs::remove_all(dir);
}

// Spans carry where they ran: the unit, micro-batch and pass the calling thread set (scoped, restored
// after), written as trace args and read back; another thread's context is its own.
TEST(Tracer, SpansCarryTheirUnitMicroBatchAndPass) {
  Tracer t(Tracer::Mode::Full, 0);
  {
    ScopedSpanContext step(SpanContext::kNoUnit, nullptr, 3);
    {
      ScopedSpanContext block(2, "BI");
      Span s(&t, "gemm_bwd_data", Category::Gemm, 1, 1);
    }
    Span s(&t, "adamw", Category::Kernel);
  }
  std::thread([&] { Span s(&t, "other_thread", Category::Kernel); }).join();
  EXPECT_EQ(span_context().micro_batch, -1) << "restored after the scope";
  auto path = std::filesystem::temp_directory_path() / ("loom-trace-ctx-" + std::to_string(::getpid()) + ".json");
  t.write_chrome_trace(path.string());
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in);
  std::map<std::string, nlohmann::json> args;
  for (auto& e : j["traceEvents"])
    if (e["ph"] == "X") args[e["name"].get<std::string>()] = e["args"];
  EXPECT_EQ(args["gemm_bwd_data"]["unit"], 2);
  EXPECT_EQ(args["gemm_bwd_data"]["micro_batch"], 3);
  EXPECT_EQ(args["gemm_bwd_data"]["pass"], "BI");
  EXPECT_EQ(args["adamw"]["micro_batch"], 3);
  EXPECT_FALSE(args["adamw"].contains("unit"));
  EXPECT_FALSE(args["other_thread"].contains("micro_batch"));
  std::filesystem::remove(path);
}
