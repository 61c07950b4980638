// Validation of the cost model against published training results (a TOML file of rows, see
// tests/plan/published_results.toml): each row's fixed layout is planned -- unstated knobs (micro-batch,
// virtual stages) are chosen by the planner -- and the prediction compared in the row's own FLOP
// convention. Also fits the best constant-utilisation predictor to the same rows, as the bar to beat, and
// the model's own one global number (the GEMM efficiency) the same way, in sample and leave-one-out.
#pragma once

#include <map>
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
  // "in-sample": a fitted constant may see the row; "held-out": none ever does (the validation of
  // record). `source` names where its figures come from.
  std::string set = "in-sample", source;
  Job job;
  Fixed fixed;
  int devices = 0, tp = 1, pp = 1;
  std::optional<double> tflops_96, iteration_full_s, iteration_selective_s, mfu;
  // Throughput as vendors publish it (tokens/s per device; `sequences_per_s` of the whole job is read
  // into it), predicted under the row's own recompute / ZeRO / cp (or the planner's choice where the
  // source states none).
  std::optional<double> tokens_per_s_per_device;
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
  std::string set;          // the row's set: "in-sample" or "held-out"
  std::string hardware;     // the row's hardware file
  std::string memory_note;  // set when the memory model says the published layout does not fit
  double error() const;     // relative error, in throughput terms for time rows
  double constant_error() const;
};

// Throughput errors of one set of rows, beside the best constant-utilisation predictor fitted to those
// same rows (the hardest constant to beat: it has seen the answers).
struct SetErrors {
  int lines = 0;
  double mean = 0, worst = 0;
  double constant_utilisation = 0, constant_mean = 0, constant_worst = 0;
  double constant_loo_mean = 0;  // each line predicted with the utilisation that fits the others best
  double ratio() const { return constant_mean > 0 ? mean / constant_mean : 0; }
};

// A device family's GEMM-efficiency scale fitted to its in-sample rows only (1 = the shipped value is
// already the fit). What the hardware file's `efficiency.gemm_max` should be, and how well it fits.
struct FamilyFit {
  std::string hardware;
  int in_sample_lines = 0, held_out_lines = 0;
  double gemm_max = 0;   // shipped
  double scale = 1;      // fitted on in-sample lines (1 when there are none)
  double in_sample_mean = 0;  // with the fitted scale
};

// A software profile's no_recompute_slowdown fitted to its in-sample rows only (what the profile should
// ship), for the profiles with an in-sample row the knob moves.
struct ProfileFit {
  std::string software;
  int in_sample_rows = 0;  // the in-sample throughput lines the knob moves (no full recompute)
  double shipped = 0, fitted = 0;
  double shipped_mean = 0, fitted_mean = 0;  // the rows' mean throughput error with each
};

struct ValidationReport {
  std::vector<ValidationLine> lines;
  double constant_utilisation = 0;  // fitted hardware-FLOP utilisation of the constant predictor
  double throughput_mean = 0, throughput_worst = 0;
  double constant_mean = 0, constant_worst = 0;
  double constant_loo_mean = 0;  // the constant predicting each row with u fitted to the other rows
  // The model with one global GEMM-efficiency scale fitted like the constant (shipped constants: scale 1).
  double gemm_scale_fitted = 1, gemm_fitted_mean = 0, gemm_loo_mean = 0;
  // By set, with the shipped constants: "in-sample" and "held-out" (absent when a file has no such rows).
  std::map<std::string, SetErrors> sets;
  std::vector<FamilyFit> families;
  std::vector<ProfileFit> profiles;
  // Rows whose published layout ran though the memory model says it does not fit (a memory-model miss;
  // their time is still predicted).
  std::vector<std::string> over_memory;
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
// Several files validated as one set of rows (`loom plan --validate A --validate B`); row names must be
// unique across them.
ValidationReport validate_files(const std::vector<std::string>& paths, const std::vector<std::string>& hardware_dirs);

}  // namespace loom::plan
