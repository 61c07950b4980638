// Search over every valid layout of a job: enumerate degrees, micro-batch, virtual stages, ZeRO stage,
// recompute, SP and schedule; drop those that do not divide the model or batch, or do not fit memory
// (counting each reason); rank the rest by predicted step time. Also: the what-if sensitivity of a
// chosen layout to each hardware figure.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/plan/memory_model.h"
#include "loom/plan/time_model.h"

namespace loom::plan {

// Degrees or options pinned by the user (--fix tp=8 pp=2 ...). Unset fields are searched.
struct Fixed {
  std::optional<int> dp, tp, pp, cp, ep, vpp, micro_batch, zero;
  std::optional<bool> sp;
  std::optional<Recompute> recompute;
  std::optional<Schedule> schedule;
  std::optional<bool> cp_all_to_all;  // cp_mode=all-to-all (Ulysses); ring otherwise
};
// Parses "key=value" (keys: dp tp pp cp cp_mode ep v|vpp mb|micro_batch zero sp recompute
// schedule);
// throws ConfigError naming the key and the valid choices.
void apply_fix(Fixed& f, const std::string& key_value);

struct Candidate {
  Layout layout;
  MemoryBreakdown memory;
  StepTime time;
};

struct SearchResult {
  std::vector<Candidate> ranked;           // fastest first, at most `top`
  int64_t evaluated = 0;
  std::map<Reject, int64_t> rejected;      // how many layouts were dropped, by reason
  std::map<Reject, std::string> example;   // one message per reason
  int64_t feasible = 0;
  // What --fix pinned that the search itself would not try (tp across nodes), one line each.
  std::vector<std::string> warnings;
};

// Throws ConfigError when the job is invalid or when no layout is feasible (saying why, with counts).
SearchResult search(const Job& job, const Fixed& fixed, int top);

// What-if: the step time of `layout` (and of the re-planned best layout) with one hardware figure
// scaled by `factor`.
struct Sensitivity {
  std::string figure;  // "peak FLOP/s", "memory bandwidth", "memory capacity", "intra-node link", ...
  double factor = 1;
  bool better = false;     // the figure improves (x2, or x0.5 for latency)
  double same_layout = 0;  // seconds; 0 when the layout no longer fits
  double replanned = 0;    // seconds of the best layout found again; 0 when none fits
};
std::vector<Sensitivity> sensitivity(const Job& job, const Fixed& fixed, const Layout& layout);

// The answer the what-if is for: which figure, made twice as good (x2; latency x0.5), shortens the
// (re-planned) step most, and which, made twice as bad, lengthens it most (a layout that no longer fits
// counts as infinitely slow). Fractions of `base` (the current step): gain < 0, loss > 0.
struct SensitivityVerdict {
  std::string pays_most;
  double gain = 0;
  std::string hurts_most;
  double loss = 0;  // +inf when halving it leaves no layout that fits
};
SensitivityVerdict sensitivity_verdict(const std::vector<Sensitivity>& rows, double base);

}  // namespace loom::plan
