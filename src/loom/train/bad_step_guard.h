// Which training steps are not applied: a non-finite loss or gradient norm, or a loss spike (the
// step's loss above the mean of the last accepted steps' by more than `spike_zscore` of their standard
// deviations). A skipped step takes no optimizer update; the run stops, with an error naming the step
// and the reason, after more than `max_consecutive` skips in a row (0: at the first bad step). The loss
// and the norm it judges are the ones reduced over every rank, so every rank decides the same.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

namespace loom::train {

class BadStepGuard {
 public:
  enum class Verdict { Apply, NonFiniteLoss, NonFiniteGradient, LossSpike };

  // spike_zscore 0: no spike detection. spike_window: accepted steps the mean and deviation are taken
  // over (a spike is judged only once the window is full).
  BadStepGuard(int64_t max_consecutive, double spike_zscore, int64_t spike_window);

  Verdict judge(double loss, double grad_norm) const;
  // Why a loss is a spike, with the window's figures ("" when it is not one).
  std::string spike_detail(double loss) const;
  // The step was applied: the loss joins the window and the run of skips ends.
  void applied(double loss);
  // The step was skipped for `reason`; throws NumericError past max_consecutive skips in a row.
  void skipped(int64_t step, const std::string& reason);
  int64_t skipped_total() const { return skipped_total_; }
  int64_t consecutive() const { return consecutive_; }

 private:
  void window_stats(double& mean, double& stddev) const;

  int64_t max_consecutive_;
  double spike_zscore_;
  size_t spike_window_;
  std::deque<double> recent_;
  int64_t consecutive_ = 0, skipped_total_ = 0;
};

}  // namespace loom::train
