// Which steps are not applied (train/bad_step_guard.h): non-finite losses and gradient norms always,
// loss spikes by their z-score over the last applied steps once the window is full, and the run stops
// after more than train.max_consecutive_skips skips in a row, naming the step and the reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "loom/error.h"
#include "loom/train/bad_step_guard.h"

namespace loom::train {
namespace {

using ::testing::HasSubstr;
using Verdict = BadStepGuard::Verdict;
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

TEST(BadStepGuard, NonFiniteLossOrGradientIsNeverApplied) {
  const BadStepGuard g(3, 0, 50);
  EXPECT_EQ(g.judge(2.0, 1.0), Verdict::Apply);
  EXPECT_EQ(g.judge(kNan, 1.0), Verdict::NonFiniteLoss);
  EXPECT_EQ(g.judge(INFINITY, 1.0), Verdict::NonFiniteLoss);
  EXPECT_EQ(g.judge(2.0, kNan), Verdict::NonFiniteGradient);
  EXPECT_EQ(g.judge(2.0, INFINITY), Verdict::NonFiniteGradient);
}

TEST(BadStepGuard, ALossSpikeIsJudgedOverTheLastAppliedStepsOnceTheWindowIsFull) {
  BadStepGuard g(3, 3.0, 4);
  for (double l : {2.0, 2.1, 1.9}) {
    EXPECT_EQ(g.judge(10.0, 1.0), Verdict::Apply) << "window not full yet";
    g.applied(l);
  }
  g.applied(2.0);  // window: 2.0 2.1 1.9 2.0 (mean 2.0, sample std 0.0816)
  EXPECT_EQ(g.judge(2.2, 1.0), Verdict::Apply);      // z = 2.45
  EXPECT_EQ(g.judge(2.3, 1.0), Verdict::LossSpike);  // z = 3.67
  EXPECT_THAT(g.spike_detail(2.3), HasSubstr("3.7 standard deviations above the mean 2.0000 of the last 4"));
  EXPECT_EQ(g.judge(1.0, 1.0), Verdict::Apply) << "a drop is never a spike";
  // The window slides: older losses leave it.
  for (int i = 0; i < 4; ++i) g.applied(2.25 + 0.05 * (i % 2));
  EXPECT_EQ(g.judge(2.3, 1.0), Verdict::Apply);
  EXPECT_EQ(BadStepGuard(3, 0, 4).judge(1e9, 1.0), Verdict::Apply) << "zscore 0: no spike detection";
}

TEST(BadStepGuard, TheRunStopsAfterMoreThanTheAllowedSkipsInARow) {
  BadStepGuard g(2, 0, 50);
  g.skipped(5, "r5");
  g.skipped(6, "r6");
  EXPECT_EQ(g.consecutive(), 2);
  g.applied(2.0);  // an applied step ends the run of skips
  EXPECT_EQ(g.consecutive(), 0);
  g.skipped(8, "r8");
  g.skipped(9, "r9");
  try {
    g.skipped(10, "the gradient of 'w' is non-finite");
    FAIL() << "expected a NumericError";
  } catch (const NumericError& e) {
    EXPECT_THAT(e.what(), HasSubstr("step 10: the gradient of 'w' is non-finite; 3 steps in a row were not applied "
                                    "(train.max_consecutive_skips = 2)"));
  }
  EXPECT_EQ(g.skipped_total(), 5);
  BadStepGuard strict(0, 0, 50);
  EXPECT_THROW(strict.skipped(1, "the loss is nan"), NumericError);
}

}  // namespace
}  // namespace loom::train
