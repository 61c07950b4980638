// `loom profile report` on traces whose answers are worked out by hand: unions of compute, exposed and
// overlapped communication, pipeline waits and host time per step; the rank that arrives last at a
// collective; kernels against the roofline; the verdict and the opportunities; bad traces refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loom/error.h"
#include "loom/profile/intervals.h"
#include "loom/profile/step_report.h"

namespace loom::profile {
namespace {

using ::testing::HasSubstr;

// A trace as Loom writes it: times in milliseconds here, microseconds in the file.
struct TraceBuilder {
  nlohmann::json events = nlohmann::json::array();
  void add(const std::string& name, const std::string& cat, int rank, double start_ms, double dur_ms, double flops = 0,
           double bytes = 0) {
    events.push_back({{"name", name}, {"cat", cat}, {"ph", "X"}, {"ts", start_ms * 1e3}, {"dur", dur_ms * 1e3},
                      {"pid", rank}, {"tid", 1}, {"args", {{"flops", flops}, {"bytes", bytes}}}});
  }
  // A span that names its collective (group, sequence number) or peer, as comm::mark_wait and the
  // progress thread write them.
  void add_op(const std::string& name, const std::string& cat, int rank, double start_ms, double dur_ms,
              const std::string& group, int64_t seq) {
    add(name, cat, rank, start_ms, dur_ms);
    events.back()["args"]["group"] = group;
    events.back()["args"]["seq"] = seq;
  }
  std::vector<TraceSpan> spans() const {
    nlohmann::json j{{"traceEvents", events}};
    return parse_chrome_trace(j.dump(), "test trace");
  }
};

TEST(Intervals, UnionIntersectAndClip) {
  const auto u = union_of({{0, 2}, {1, 3}, {5, 6}, {6, 7}, {8, 8}});
  ASSERT_EQ(u.size(), 2u);
  EXPECT_DOUBLE_EQ(length(u), 5);
  EXPECT_DOUBLE_EQ(length(intersect(u, union_of({{2, 5.5}}))), 1.5);
  EXPECT_DOUBLE_EQ(length(clip(u, {1, 6.5})), 3.5);
  const auto d = subtract(u, union_of({{0.5, 1}, {2, 5.5}}));  // {0,0.5} {1,2} {5.5,7}
  ASSERT_EQ(d.size(), 3u);
  EXPECT_DOUBLE_EQ(length(d), 3);
}

// Each 10 ms step: a GEMM [1, 4), a kernel [3, 6) (compute union 5, GEMM 3, other 3), a wait [6, 8),
// an asynchronous collective in flight [2, 9) (4 of it under compute), so 3 ms of host time.
TEST(TraceAnalysis, HandWorkedStepBreakdown) {
  TraceBuilder t;
  for (int s = 0; s < 3; ++s) {
    const double b = 10.0 * s;
    t.add("step", "step", 0, b, 10);
    t.add("gemm_fwd", "gemm", 0, b + 1, 3, 3e9, 1e6);
    t.add("gelu_fwd", "kernel", 0, b + 3, 3, 1e6, 3e7);
    t.add("dp_all_reduce_wait", "comm", 0, b + 6, 2);
    t.add("tp_all_reduce", "comm_in_flight", 0, b + 2, 7);
    t.add("all_reduce", "comm_work", 0, b + 3.5, 1);  // beside compute: hidden, not exposed
  }
  const auto a = analyse_trace(t.spans(), 1);
  ASSERT_EQ(a.ranks.size(), 1u);
  const auto& r = a.ranks[0];
  EXPECT_EQ(r.steps, 2);
  EXPECT_NEAR(r.step, 10e-3, 1e-12);
  EXPECT_NEAR(r.compute, 5e-3, 1e-12);
  EXPECT_NEAR(r.gemm, 3e-3, 1e-12);
  EXPECT_NEAR(r.other, 3e-3, 1e-12);
  EXPECT_NEAR(r.comm_exposed, 2e-3, 1e-12);
  EXPECT_NEAR(r.comm_sum, 2e-3, 1e-12);
  EXPECT_NEAR(r.in_flight, 7e-3, 1e-12);
  EXPECT_NEAR(r.overlapped, 4e-3, 1e-12);
  EXPECT_NEAR(r.host, 3e-3, 1e-12);
  EXPECT_NEAR(r.idle, 0, 1e-12);
  EXPECT_NEAR(r.flops, 3e9 + 1e6, 1);
  // The GEMM: 3e9 FLOP in 3 ms = 1 TFLOP/s, intensity 3000 FLOP/B: compute-bound at half a 2 TFLOP/s peak.
  // The kernel: 3e7 B in 3 ms = 10 GB/s, intensity 0.03: memory-bound at a quarter of a 40 GB/s roof.
  const auto report = build_report(a, Roofline{2e12, 40e9, "test"}, RunFacts{});
  ASSERT_EQ(report.kernels.size(), 2u);
  const auto& gemm = report.kernels[0].k.name == "gemm_fwd" ? report.kernels[0] : report.kernels[1];
  const auto& gelu = report.kernels[0].k.name == "gemm_fwd" ? report.kernels[1] : report.kernels[0];
  EXPECT_EQ(gelu.k.name, "gelu_fwd");
  EXPECT_TRUE(gemm.compute_bound);
  EXPECT_NEAR(gemm.share_of_roof(), 0.5, 1e-9);
  EXPECT_FALSE(gelu.compute_bound);
  EXPECT_NEAR(gelu.share_of_roof(), 0.25, 1e-9);
  // Compute 5 ms split 3:3 between the two: 2.5 compute-bound, 2.5 memory-bound; 3 ms host; 2 ms waits.
  EXPECT_EQ(report.bound_by, "host overhead");
  EXPECT_NEAR(report.bound_share, 0.3, 1e-9);
  EXPECT_NEAR(report.compute_bound, 2.5e-3, 1e-12);
  EXPECT_NEAR(report.memory_bound, 2.5e-3, 1e-12);
  // Opportunities: host 3 ms, memory-bound loss 2.5 x 0.75 = 1.875 ms, collectives 2 ms, compute 1.25 ms.
  ASSERT_EQ(report.opportunities.size(), 3u);
  EXPECT_EQ(report.opportunities[0].where, "host loop");
  EXPECT_EQ(report.opportunities[1].where, "collective algorithm");
  EXPECT_EQ(report.opportunities[2].where, "kernel");
  EXPECT_NEAR(report.opportunities[2].seconds, 1.875e-3, 1e-12);
  EXPECT_THAT(report.opportunities[2].what, HasSubstr("gelu_fwd at 25%"));
  EXPECT_THAT(format_report(report), HasSubstr("verdict: bound by host overhead: 30% of the step"));
}

// Waits that name their collective are matched by (group, sequence number), not by name and order: three
// ranks of group g run the same all-reduces; rank 2 arrives last every time and never waits (its
// progress thread's work span is all the trace has of it there), ranks 0 and 1 wait 3 and 5 ms. A
// second group h's wait under the same name on rank 0 alone, with no partner in the trace, is not mixed in.
TEST(TraceAnalysis, WaitsThatNameTheirCollectiveAreMatchedAcrossRanksExactly) {
  TraceBuilder t;
  int64_t seq = 0;
  for (int s = 0; s < 4; ++s) {
    const double b = 20.0 * s;
    ++seq;
    for (int rank : {0, 1, 2}) {
      t.add("step", "step", rank, b, 20);
      t.add("gemm_fwd", "gemm", rank, b, 5, 1e9, 1e6);
      if (rank < 2) t.add_op("tp_all_reduce_out.wait", "comm", rank, b + 5, rank == 0 ? 3 : 5, "g", seq);
      t.add_op("all_reduce", "comm_work", rank, b + 9, 1, "g", seq);
    }
    t.add_op("tp_all_reduce_out.wait", "comm", 0, b + 12, 2, "h", seq);
  }
  const auto a = analyse_trace(t.spans(), 0);
  ASSERT_EQ(a.stragglers.size(), 1u);
  EXPECT_EQ(a.stragglers[0].op, "tp_all_reduce_out.wait");
  EXPECT_EQ(a.stragglers[0].last_rank, 2);
  EXPECT_NEAR(a.stragglers[0].others_waited, 4e-3, 1e-12);  // (3 + 5) / 2 per step
  // The spans carry what they name.
  bool found = false;
  for (const auto& s : t.spans())
    found = found || (s.name == "all_reduce" && s.group == "g" && s.seq == 1 && s.peer == -1);
  EXPECT_TRUE(found);
}

// Two ranks: rank 1 computes 4 ms longer before the all-reduce, so rank 0 waits 5 ms and rank 1 1 ms:
// rank 1 arrived last and made rank 0 wait 4 ms per step; it is also the slowest rank.
TEST(TraceAnalysis, TheRankThatArrivesLastIsNamedWithTheWaitItCaused) {
  TraceBuilder t;
  for (int s = 0; s < 4; ++s) {
    const double b = 20.0 * s;
    for (int rank : {0, 1}) {
      t.add("step", "step", rank, b, 20);
      t.add("gemm_fwd", "gemm", rank, b, rank ? 10 : 6, 1e9, 1e6);
      t.add("dp_all_reduce_wait", "comm", rank, b + (rank ? 10 : 6), rank ? 1 : 5);
    }
  }
  const auto a = analyse_trace(t.spans(), 0);
  EXPECT_EQ(a.slowest_rank, 1);
  ASSERT_EQ(a.stragglers.size(), 1u);
  EXPECT_EQ(a.stragglers[0].op, "dp_all_reduce_wait");
  EXPECT_EQ(a.stragglers[0].last_rank, 1);
  EXPECT_NEAR(a.stragglers[0].others_waited, 4e-3, 1e-12);
  const auto report = build_report(a, Roofline{1e12, 0, "test"}, RunFacts{});
  // Waits are 3 ms of the job's mean, most of it rank 1's lateness: the fix is balance, not the algorithm.
  bool named = false;
  for (const auto& o : report.opportunities)
    named = named || (o.where == "parallel layout" && o.what.find("rank 1 arrives last at dp_all_reduce_wait") == 0);
  EXPECT_TRUE(named) << format_report(report);
}

// A pipeline stage that waits 12 of every 20 ms on its neighbour is bound by the bubble; MFU from the
// run's facts: 1000 tokens x 1e6 FLOP per token in 20 ms on 1 rank of 1e12 peak = 5%.
TEST(TraceAnalysis, APipelineBoundStepGetsThatVerdictAndMfu) {
  TraceBuilder t;
  for (int s = 0; s < 3; ++s) {
    const double b = 20.0 * s;
    t.add("step", "step", 0, b, 20);
    t.add("gemm_fwd", "gemm", 0, b, 6, 5e9, 1e6);
    t.add("pp_transfer_wait", "comm", 0, b + 6, 12);
  }
  const auto report = build_report(analyse_trace(t.spans(), 0), Roofline{1e12, 1e10, "test"}, RunFacts{1000, 1e6});
  EXPECT_EQ(report.bound_by, "pipeline bubble");
  EXPECT_NEAR(report.bound_share, 0.6, 1e-9);
  EXPECT_NEAR(report.mfu, 0.05, 1e-9);
  EXPECT_NEAR(report.hfu, 0.25, 1e-9);  // 5e9 FLOP per 20 ms step
  ASSERT_FALSE(report.opportunities.empty());
  EXPECT_EQ(report.opportunities[0].where, "parallel layout");
  EXPECT_THAT(report.opportunities[0].what, HasSubstr("zb-h1"));
  const auto j = report_json(report);
  EXPECT_EQ(j["verdict"]["bound_by"], "pipeline bubble");
  EXPECT_NEAR(j["job"]["pipeline_wait_s"].get<double>(), 12e-3, 1e-12);
}

TEST(TraceAnalysis, BadTracesAreRefusedNamingTheProblem) {
  EXPECT_THROW(parse_chrome_trace("not json", "t.json"), IoError);
  try {
    parse_chrome_trace("{\"events\": []}", "t.json");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("'t.json' has no \"traceEvents\" array"));
  }
  try {
    parse_chrome_trace(R"({"traceEvents": [{"ph": "X", "cat": "gemm", "name": "g"}]})", "t.json");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_THAT(e.what(), HasSubstr("event 0 is malformed"));
  }
  TraceBuilder t;
  t.add("gemm_fwd", "gemm", 0, 0, 1);
  try {
    analyse_trace(t.spans(), 0);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no \"step\" span"));
  }
}

}  // namespace
}  // namespace loom::profile
