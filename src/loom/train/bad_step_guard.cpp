#include "loom/train/bad_step_guard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "loom/error.h"

namespace loom::train {

BadStepGuard::BadStepGuard(int64_t max_consecutive, double spike_zscore, int64_t spike_window)
    : max_consecutive_(max_consecutive),
      spike_zscore_(spike_zscore),
      spike_window_(static_cast<size_t>(spike_window > 1 ? spike_window : 2)) {}

void BadStepGuard::window_stats(double& mean, double& stddev) const {
  mean = 0;
  for (double l : recent_) mean += l;
  mean /= static_cast<double>(recent_.size());
  double var = 0;
  for (double l : recent_) var += (l - mean) * (l - mean);
  stddev = std::sqrt(var / static_cast<double>(recent_.size() - 1));
}

BadStepGuard::Verdict BadStepGuard::judge(double loss, double grad_norm) const {
  if (!std::isfinite(loss)) return Verdict::NonFiniteLoss;
  if (!std::isfinite(grad_norm)) return Verdict::NonFiniteGradient;
  if (!spike_detail(loss).empty()) return Verdict::LossSpike;
  return Verdict::Apply;
}

std::string BadStepGuard::spike_detail(double loss) const {
  if (spike_zscore_ <= 0 || recent_.size() < spike_window_) return "";
  double mean = 0, stddev = 0;
  window_stats(mean, stddev);
  // A window of (nearly) identical losses has next to no spread: the deviation is floored at 0.1% of the
  // mean, so rounding noise on a plateau is not a spike.
  const double z = (loss - mean) / std::max(stddev, 1e-3 * std::abs(mean) + 1e-12);
  if (z <= spike_zscore_) return "";
  return fmt::format("the loss {:.4f} is a spike: {:.1f} standard deviations above the mean {:.4f} of the last {} "
                     "applied steps (train.loss_spike_zscore = {})",
                     loss, z, mean, recent_.size(), spike_zscore_);
}

void BadStepGuard::applied(double loss) {
  consecutive_ = 0;
  recent_.push_back(loss);
  while (recent_.size() > spike_window_) recent_.pop_front();
}

void BadStepGuard::skipped(int64_t step, const std::string& reason) {
  ++consecutive_, ++skipped_total_;
  if (consecutive_ <= max_consecutive_) return;
  if (max_consecutive_ == 0)
    throw NumericError(fmt::format("step {}: {}; the step is not applied and train.max_consecutive_skips = 0 stops "
                                   "the run: lower train.lr, check the data, or resume from an earlier checkpoint",
                                   step, reason));
  throw NumericError(fmt::format("step {}: {}; {} steps in a row were not applied (train.max_consecutive_skips = {}): "
                                 "lower train.lr, check the data, or resume from an earlier checkpoint",
                                 step, reason, consecutive_, max_consecutive_));
}

}  // namespace loom::train
