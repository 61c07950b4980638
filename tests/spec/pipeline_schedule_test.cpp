// Pipeline schedules as data: every schedule, for many pp / v / m, runs every pass once, respects every
// dependency and deadlocks nowhere (a unit-time simulation), holds the activations it promises (1F1B: at
// most pp - r micro-batches on rank r; GPipe: all m), and has the textbook bubble.
#include "loom/spec/pipeline_schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "loom/error.h"

namespace loom::spec {
namespace {

using ::testing::HasSubstr;

TEST(PipelineSchedule, EveryScheduleRunsEveryPassOnceWithoutDeadlock) {
  for (auto kind : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                    PipelineSchedule::ZeroBubbleH1})
    for (int pp : {1, 2, 3, 4, 8})
      for (int m : {1, 2, 3, 4, 8, 12, 16})
        for (int v : {1, 2, 3}) {
          if ((kind == PipelineSchedule::Interleaved1F1B) != (v > 1)) continue;
          if (kind == PipelineSchedule::Interleaved1F1B && m % pp != 0) continue;
          SCOPED_TRACE(std::string(schedule_name(kind)) + " pp=" + std::to_string(pp) + " v=" + std::to_string(v) +
                       " m=" + std::to_string(m));
          const auto plan = build_pipeline_schedule(kind, pp, v, m);
          ASSERT_EQ(plan.ranks.size(), static_cast<size_t>(pp));
          const auto run = simulate(plan);
          ASSERT_TRUE(run.ok) << run.problem;
          for (int r = 0; r < pp; ++r) {
            const int peak = run.peak_in_flight[static_cast<size_t>(r)];
            switch (kind) {
              case PipelineSchedule::GPipe: EXPECT_EQ(peak, m) << "GPipe holds every micro-batch"; break;
              case PipelineSchedule::OneFOneB:
              case PipelineSchedule::ZeroBubbleH1: EXPECT_EQ(peak, std::min(m, pp - r)) << "rank " << r; break;
              case PipelineSchedule::Interleaved1F1B:
                EXPECT_LE(peak, std::min(m * v, 2 * (pp - r - 1) + (v - 1) * pp + 1)) << "rank " << r;
                break;
            }
          }
        }
}

TEST(PipelineSchedule, BubblesAreTheTextbookOnes) {
  // 1F1B / GPipe with F = 1, B = 2: the idle share of every rank is (p - 1) / (m + p - 1).
  for (auto kind : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB})
    for (int pp : {2, 4})
      for (int m : {2, 4, 8}) {
        const auto plan = build_pipeline_schedule(kind, pp, 1, m);
        const auto run = simulate(plan);
        for (double idle : run.idle) EXPECT_NEAR(idle, theoretical_bubble(plan), 1e-9) << pp << " " << m;
      }
  // Interleaving cuts the bubble by about v; zero-bubble's weight passes fill part of it.
  const auto one = simulate(build_pipeline_schedule(PipelineSchedule::OneFOneB, 4, 1, 8));
  const auto inter = build_pipeline_schedule(PipelineSchedule::Interleaved1F1B, 4, 2, 8);
  const auto zb = simulate(build_pipeline_schedule(PipelineSchedule::ZeroBubbleH1, 4, 1, 8));
  const double one_idle = one.idle[0];
  EXPECT_LT(simulate(inter).idle[0], 0.75 * one_idle);
  EXPECT_NEAR(theoretical_bubble(inter), one_idle / 2, 1e-9);
  EXPECT_LT(zb.idle[0], one_idle);
}

// The executor's contexts: on the first stage (whose forwards receive nothing) exactly the micro-batches
// in flight; elsewhere at most one more (a forward's receive is posted while the previous backward sends);
// validation needs at most two per chunk.
TEST(PipelineSchedule, TheExecutorHoldsTheContextsTheSchedulePromises) {
  for (auto kind : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                    PipelineSchedule::ZeroBubbleH1})
    for (int pp : {2, 4})
      for (int m : {1, 2, 4, 8}) {
        const int v = kind == PipelineSchedule::Interleaved1F1B ? 2 : 1;
        if (kind == PipelineSchedule::Interleaved1F1B && m % pp != 0) continue;
        const auto plan = build_pipeline_schedule(kind, pp, v, m);
        const auto run = simulate(plan);
        for (int r = 0; r < pp; ++r) {
          SCOPED_TRACE(std::string(schedule_name(kind)) + " pp=" + std::to_string(pp) + " m=" + std::to_string(m) +
                       " rank " + std::to_string(r));
          const auto held = contexts_held(plan, r);
          int total = 0;
          for (int n : held) total += n;
          if (v == 1 && r == 0) {
            EXPECT_EQ(total, run.peak_in_flight[0]);
          }
          if (v == 1 && r > 0) {
            EXPECT_GE(total, run.peak_in_flight[static_cast<size_t>(r)]);
            EXPECT_LE(total, run.peak_in_flight[static_cast<size_t>(r)] + 1);
          }
          // Zero-bubble keeps a micro-batch's context until its weight pass, within 1F1B's cap.
          if ((kind == PipelineSchedule::OneFOneB || kind == PipelineSchedule::ZeroBubbleH1) && r == 0) {
            EXPECT_EQ(total, std::min(m, pp));
          }
          if (kind == PipelineSchedule::GPipe) {
            EXPECT_GE(total, m);
          }
          for (int n : contexts_held(plan, r, true)) EXPECT_LE(n, std::min(m, 2));
        }
      }
}

TEST(PipelineSchedule, OneFOneBInterleavesAfterTheWarmUp) {
  const auto plan = build_pipeline_schedule(PipelineSchedule::OneFOneB, 4, 1, 6);
  // Rank 0: three warm-up forwards, then F3 B0 F4 B1 F5 B2, then B3 B4 B5.
  std::string got;
  for (const auto& a : plan.ranks[0]) got += std::string(pass_name(a.pass)) + std::to_string(a.micro_batch) + " ";
  EXPECT_EQ(got, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  std::string last;
  for (const auto& a : plan.ranks[3]) last += std::string(pass_name(a.pass)) + std::to_string(a.micro_batch) + " ";
  EXPECT_EQ(last, "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 ");
}

TEST(PipelineSchedule, ABrokenPlanIsCaughtByTheSimulation) {
  auto plan = build_pipeline_schedule(PipelineSchedule::OneFOneB, 2, 1, 2);
  // Rank 1 running B1 before B0 is fine; rank 0 running B before the forwards it needs is not.
  std::swap(plan.ranks[0][0], plan.ranks[0][3]);
  const auto run = simulate(plan);
  EXPECT_FALSE(run.ok);
  EXPECT_THAT(run.problem, HasSubstr("deadlock"));
  auto dup = build_pipeline_schedule(PipelineSchedule::GPipe, 2, 1, 2);
  dup.ranks[1].push_back(dup.ranks[1][0]);
  EXPECT_THAT(simulate(dup).problem, HasSubstr("twice"));
}

TEST(PipelineSchedule, SchedulesThatCannotRunAreRefusedWithAnAlternative) {
  auto error = [](PipelineSchedule k, int pp, int v, int m) {
    try {
      build_pipeline_schedule(k, pp, v, m);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_THAT(error(PipelineSchedule::Interleaved1F1B, 4, 1, 8), HasSubstr("needs parallel.pipeline.virtual_stages >= 2"));
  EXPECT_THAT(error(PipelineSchedule::Interleaved1F1B, 4, 2, 6), HasSubstr("is not a multiple; use 8 or 4"));
  EXPECT_THAT(error(PipelineSchedule::OneFOneB, 4, 2, 8), HasSubstr("needs the \"interleaved-1f1b\" schedule"));
  EXPECT_THAT(error(PipelineSchedule::GPipe, 2, 1, 0), HasSubstr("at least one micro-batch"));
  EXPECT_THROW(parse_schedule("pipedream"), ConfigError);
  EXPECT_EQ(parse_schedule("zb-h1"), PipelineSchedule::ZeroBubbleH1);
}

}  // namespace
}  // namespace loom::spec
