// The closed loop between the planner and the profiler: the time model's prediction for a run, next to
// what the run measured, class by class, and the term of the model that misses most. `loom profile
// report` prints it for every traced run (cli/run_prediction.h builds the job from the run's config);
// bench/plan_vs_measured.sh runs it over the layouts Loom runs.
#pragma once

#include <string>
#include <vector>

#include "loom/plan/time_model.h"

namespace loom::plan {

// A step as the profiler measured it, in seconds, on the ranks the time model prices (the last
// pipeline stage, the one the model prices as slowest; every rank without pipeline parallelism).
struct MeasuredStep {
  double step = 0;
  double gemm = 0;          // union of GEMM spans
  double attention = 0;     // attention kernels' share of the other kernels' union
  double other = 0;         // every other kernel (norms, activations, loss, optimizer, casts)
  double comm_exposed = 0;  // collective waits no compute ran beside
  double pipeline = 0;      // waits on pipeline transfers: the bubble and exposed point-to-point
  double host = 0;          // the step's time outside every kernel and wait
};

struct ClassCheck {
  std::string name;       // "GEMM", "attention", ...
  double predicted = 0, measured = 0;
  std::string term;       // the time model's term that prices this class (what to fix when it misses)
  bool modelled = true;   // false: the time model has no such term (host overhead)
  // (predicted - measured) / measured; 0 when both are 0, +inf when only the prediction is not.
  double error() const;
};

struct PredictionCheck {
  std::vector<ClassCheck> classes;  // GEMM, attention, memory-bound kernels, communication, pipeline, host, step
  int most_wrong = -1;              // index of the class whose miss is the largest (seconds), -1: none missed
  // The share of the measured step a class must hold for its error to count toward the goal: below it,
  // a large relative miss is a small absolute one.
  static constexpr double kMinShare = 0.05;
  bool counts(const ClassCheck& c) const;
  double worst_error() const;  // |error| over the classes that count (the step included)
};

// `attention_flops_measured`: whether the hardware carries Loom's measured attention rate (the term is
// then device.attention_tflops, else flash attention on the GEMM curve).
PredictionCheck check_prediction(const StepTime& predicted, const MeasuredStep& measured,
                                 bool attention_flops_measured);

// The comparison as text: one line per class (predicted, measured, error, the term), then which term
// misses most and by how much of the step.
std::string format_prediction_check(const PredictionCheck& c);

}  // namespace loom::plan
