#include "loom/plan/prediction_check.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace loom::plan {

// Ten microseconds per step: below the trace's resolution for a class summed from spans.
constexpr double kNegligible = 1e-5;

double ClassCheck::error() const {
  if (measured > 0) return (predicted - measured) / measured;
  return predicted > 0 ? std::numeric_limits<double>::infinity() : 0.0;
}

bool PredictionCheck::counts(const ClassCheck& c) const {
  const double step = classes.empty() ? 0 : classes.back().measured;
  return c.modelled && step > 0 && std::max(c.measured, c.predicted) >= kMinShare * step;
}

double PredictionCheck::worst_error() const {
  double worst = 0;
  for (const auto& c : classes)
    if (counts(c)) worst = std::max(worst, std::abs(c.error()));
  return worst;
}

PredictionCheck check_prediction(const StepTime& p, const MeasuredStep& m, bool attention_flops_measured) {
  PredictionCheck out;
  out.classes = {
      {"GEMM", p.compute + p.overlap, m.gemm,
       "GEMM curve: device.peak_tflops x efficiency.gemm_max x d/(d + gemm_half_dim) per dimension"},
      {"attention", p.attention, m.attention,
       attention_flops_measured ? "device.attention_tflops (Loom's attention kernel, measured by loom calibrate)"
                                : "flash attention on the GEMM curve (no device.attention_tflops)"},
      {"memory-bound kernels", p.memory_bound - p.attention, m.other,
       "bytes each element-wise kernel and the optimizer move / (memory_bandwidth x efficiency.memory)"},
      {"exposed communication", p.comm_exposed - p.pp, m.comm_exposed,
       "collectives on the intra_node link (alpha-beta) less what the software overlaps (dp_overlap, tp_overlap)"},
      {"pipeline bubble + transfers", p.bubble + p.pp, m.pipeline,
       "(pp - 1) / v micro-batch times of the slowest stage, plus the point-to-point hops"},
      {"host overhead", 0, m.host, "not modelled: the planner assumes kernels run back to back", false},
      {"step", p.total, m.step, "the sum of the classes above"},
  };
  double worst = 0;
  for (size_t i = 0; i + 1 < out.classes.size(); ++i) {
    const double miss = std::abs(out.classes[i].predicted - out.classes[i].measured);
    if (miss > worst) worst = miss, out.most_wrong = static_cast<int>(i);
  }
  return out;
}

std::string format_prediction_check(const PredictionCheck& c) {
  std::string out = fmt::format("{:<29} {:>10} {:>10} {:>8}  {}\n", "ms per step", "planner", "measured", "error",
                                "the model's term");
  for (const auto& k : c.classes) {
    std::string err = "-";
    if (!k.modelled)
      err = "n/m";
    else if (std::max(k.measured, k.predicted) < kNegligible)
      err = "-";
    else if (std::isinf(k.error()))
      err = "new";
    else
      err = fmt::format("{:+.0f}%", 100 * k.error());
    if (k.modelled && !c.counts(k) && err != "-") err = "(" + err + ")";
    out += fmt::format("{:<29} {:>10.2f} {:>10.2f} {:>8}  {}\n", k.name, 1e3 * k.predicted, 1e3 * k.measured, err,
                       k.term);
  }
  out += fmt::format("(classes under {:.0f}% of the step in parentheses; n/m: not modelled)\n",
                     100 * PredictionCheck::kMinShare);
  const double step = c.classes.back().measured;
  if (c.most_wrong < 0) {
    out += "the planner's classes match the measurement\n";
    return out;
  }
  const auto& w = c.classes[static_cast<size_t>(c.most_wrong)];
  const double miss = w.predicted - w.measured;
  out += fmt::format("most wrong: {} ({} by {:.2f} ms, {:.0f}% of the step) -> {}\n", w.name,
                     miss > 0 ? "over-predicted" : "under-predicted", 1e3 * std::abs(miss),
                     step > 0 ? 100 * std::abs(miss) / step : 0.0, w.modelled ? "fix " + w.term : w.term);
  out += fmt::format("worst error over the classes that count: {:.0f}% (goal <= 15%)\n", 100 * c.worst_error());
  return out;
}

}  // namespace loom::plan
