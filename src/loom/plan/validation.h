// Validation of the cost model against published training results (a TOML file of rows, see
// tests/plan/published_results.toml): each row's fixed layout is planned -- unstated knobs (micro-batch,
// virtual stages) are chosen by the planner -- and the prediction compared in the row's own FLOP
// convention. Also fits the best constant-utilisation predictor to the same rows, as the bar to beat, and
// the model's own one global number (the GEMM efficiency) the same way, in sample and leave-one-out.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "loom/plan/layout.h"
#include "loom/plan/search.h"

namespace loom::plan {

// One [[row]] of a validation file, read and checked: the job and the degrees it fixes, and the
// published figures it states (an absent one is not predicted).
struct ValidationRow {
  std::string name;
  Job job;
  Fixed fixed;
  int devices = 0, tp = 1, pp = 1;
  std::optional<double> tflops_96, iteration_full_s, iteration_selective_s, mfu;
  std::optional<double> state_GiB, activations_none_GiB, activations_selective_GiB;
};

struct ValidationLine {
  std::string row;      // e.g. "SC21 T1 145.6B"
  std::string metric;   // "TFLOP/s/GPU (96*)", "iteration full (s)", "speed-up full->sel", "state (GiB)", ...
  std::string layout;   // the layout the prediction used
  double published = 0, predicted = 0;
  double constant = 0;  // the constant-utilisation predictor's value (throughput metrics only)
  bool throughput = false;  // counts toward the throughput error statistics
  std::string software;     // the row's software profile (plan/software_profile.h)
  double error() const;     // relative error, in throughput terms for time rows
  double constant_error() const;
};

struct ValidationReport {
  std::vector<ValidationLine> lines;
  double constant_utilisation = 0;  // fitted hardware-FLOP utilisation of the constant predictor
  double throughput_mean = 0, throughput_worst = 0;
  double constant_mean = 0, constant_worst = 0;
  double constant_loo_mean = 0;  // the constant predicting each row with u fitted to the other rows
  // The model with one global GEMM-efficiency scale fitted like the constant (shipped constants: scale 1).
  double gemm_scale_fitted = 1, gemm_fitted_mean = 0, gemm_loo_mean = 0;
  double speedup_worst = 0;  // Table 5 full -> selective
  double memory_worst = 0;   // Figure 1
};

// `hardware_dirs` resolve each row's `hardware` name. Throws ConfigError for malformed rows, naming
// `origin`, the row and the key.
std::vector<ValidationRow> parse_validation(const std::string& toml_text, const std::string& origin,
                                            const std::vector<std::string>& hardware_dirs);
ValidationReport validate(const std::vector<ValidationRow>& rows);
// parse_validation, then validate.
ValidationReport validate(const std::string& toml_text, const std::string& origin,
                          const std::vector<std::string>& hardware_dirs);
ValidationReport validate_file(const std::string& path, const std::vector<std::string>& hardware_dirs);

}  // namespace loom::plan
