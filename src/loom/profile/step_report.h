// The answer `loom profile report` gives: from a trace's analysis (trace_analysis.h), the machine's
// roofline and the run's facts, each kernel class against the roof, MFU / HFU / memory-bandwidth
// utilisation, a verdict ("bound by X: N% of the step") and the largest opportunities, each naming the
// layer where its fix belongs and the time per step it could save.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "loom/profile/trace_analysis.h"

namespace loom::profile {

// One rank's roofline: its peak FLOP/s and its share of the node's memory bandwidth (bytes/s; 0 when
// unknown: then no kernel is placed against the memory roof).
struct Roofline {
  double peak_flops = 0;
  double bandwidth = 0;
  std::string source;  // where the figures came from, for the report's header
  double ridge() const { return bandwidth > 0 ? peak_flops / bandwidth : 0; }  // FLOP per byte
};

// What the run's manifest says (all 0 when the trace came alone: MFU is then not reported).
struct RunFacts {
  double tokens_per_step = 0;         // over the whole job
  double model_flops_per_token = 0;
};

struct KernelRoof {
  KernelClass k;
  bool compute_bound = false;  // arithmetic intensity at or past the ridge (GEMMs when the bandwidth is unknown)
  double intensity = 0;        // FLOP per byte (0 without bytes)
  double achieved = 0;         // FLOP/s (compute-bound) or bytes/s (memory-bound)
  double roof = 0;             // the same unit's roof (0: unknown)
  double share_of_roof() const { return roof > 0 ? achieved / roof : 0; }
};

struct Opportunity {
  std::string where;  // the layer the fix belongs to: kernel, collective algorithm, parallel layout, host loop
  std::string what;
  double seconds = 0;  // per step it could save
};

struct StepReport {
  TraceAnalysis analysis;
  Roofline roof;
  RunFacts facts;
  std::vector<KernelRoof> kernels;
  // The step split into the classes the verdict weighs (seconds per step, the ranks' mean).
  double compute_bound = 0, memory_bound = 0, collectives = 0, pipeline = 0, host = 0;
  std::string bound_by;  // "compute", "memory", "collectives", "pipeline bubble" or "host overhead"
  double bound_share = 0;
  double mfu = 0, hfu = 0, bandwidth_utilisation = 0;
  std::vector<Opportunity> opportunities;  // the largest first, at most three
};

// Expert parallelism's exchanges (spans ep_*): their exposed waits per step (rank mean) and the
// collective at which the other ranks waited longest for one of them -- the straggling expert rank,
// whose experts got the most rows or whose rows arrived last.
struct ExpertExchange {
  double exposed = 0;
  std::optional<StragglerWait> straggler;
};
ExpertExchange expert_exchange(const TraceAnalysis& analysis);

StepReport build_report(const TraceAnalysis& analysis, const Roofline& roof, const RunFacts& facts);
std::string format_report(const StepReport& r);
nlohmann::json report_json(const StepReport& r);

}  // namespace loom::profile
