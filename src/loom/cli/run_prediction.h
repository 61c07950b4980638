// What the planner predicted for a traced run, next to what it measured: the planner's job and layout
// built from the run's resolved config, each rank's device taken from the machine file (or, without
// one, from the report's roofline), and the measured classes of the ranks the time model prices.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "loom/plan/hardware.h"
#include "loom/plan/layout.h"
#include "loom/plan/prediction_check.h"
#include "loom/profile/step_report.h"
#include "loom/train/run_config.h"

namespace loom::cli {

struct RunPrediction {
  std::string layout;    // the planner's name for the run's layout ("dp2 tp1 pp1 mb4 z1")
  std::string hardware;  // where the device figures came from
  std::string software;  // the software profile priced (plan::describe: "loom (...)" with the run's overlaps)
  std::string refused;   // non-empty: the planner cannot price this run (why); `check` is then empty
  int priced_stage = -1;  // under pp: the pipeline stage the planner priced (its slowest), measured on its ranks
  plan::PredictionCheck check;
};

// The planner's layout of a run's resolved config (dp, tp, sp, pp with its schedule and v, ZeRO, the
// micro-batch, recompute).
plan::Layout layout_of(const train::RunConfig& cfg);

// `machine`: a hardware file (`loom calibrate`), or none. A machine file that describes one device per
// node (a CPU) is shared by the run's `world` ranks on it: each gets 1/world of its peaks, bandwidth
// and memory, and the ranks talk over its measured intra-node link.
RunPrediction predict_run(const train::RunConfig& cfg, int world, const std::optional<plan::Hardware>& machine,
                          const profile::StepReport& report);

std::string format_run_prediction(const RunPrediction& p);
nlohmann::json run_prediction_json(const RunPrediction& p);

}  // namespace loom::cli
