// `loom profile report RUN_DIR | TRACE.json`: what a traced run's steps were bound by, per rank and for
// the job, each kernel class against this machine's roofline, and where the fix belongs
// (profile/step_report.h; docs/profiling.md).
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "loom/cli/commands.h"
#include "loom/cli/run_prediction.h"
#include "loom/comm/hang_report.h"
#include "loom/error.h"
#include "loom/kernels/stream_probe.h"
#include "loom/plan/hardware.h"
#include "loom/profile/html_report.h"
#include "loom/profile/step_report.h"
#include "loom/train/run_config.h"

namespace loom::cli {

namespace fs = std::filesystem;

namespace {

struct ProfileOptions {
  std::string path;
  std::string machine;
  double peak_flops = 0, bandwidth = 0;
  int skip_steps = 2;
  bool json = false;
  std::string html;
};

// A run directory's trace and facts: the manifest names the trace file (trace.file of its resolved
// config), the peak the run measured, the model's FLOPs per token and the tokens of a step.
struct RunInputs {
  std::string trace;
  profile::RunFacts facts;
  double peak_flops = 0;
  std::string precision = "f32";
  std::optional<train::RunConfig> config;  // the run's resolved config (none for a bare trace)
};

RunInputs read_run_dir(const fs::path& dir) {
  const fs::path manifest = dir / "manifest.json";
  std::ifstream in(manifest);
  if (!in)
    throw IoError("'" + dir.string() + "' has no manifest.json: give a run's train.out_dir, or a trace file itself");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw IoError("'" + manifest.string() + "' is not JSON (" + e.what() + ")");
  }
  RunInputs r;
  const auto cfg = train::parse_run_config(j.value("config_toml", std::string()), manifest.string());
  r.config = cfg;
  r.facts.tokens_per_step = static_cast<double>(cfg.train.batch_size * cfg.seq_len());
  r.facts.model_flops_per_token = j.value("model_flops_per_token", 0.0);
  r.peak_flops = j.value("peak_flops", 0.0);
  // Every precision but fp32 runs its GEMMs in bf16 (fp8 is emulated by bf16 GEMMs).
  r.precision = cfg.precision == model::Precision::BF16 ? "bf16" : "f32";
  if (cfg.trace.file.empty())
    throw ConfigError("the run in '" + dir.string() + "' wrote no trace: train with --set trace.file=" +
                      (dir / "trace.json").string() + " and report again");
  // The trace path as the run was given it (relative to where it started), else beside the manifest.
  fs::path trace = cfg.trace.file;
  if (!fs::exists(trace)) trace = dir / fs::path(cfg.trace.file).filename();
  if (!fs::exists(trace))
    throw IoError("the run's trace '" + cfg.trace.file + "' is not there (nor in '" + dir.string() + "')");
  r.trace = trace.string();
  return r;
}

int run_report(const ProfileOptions& o) {
  RunInputs in;
  std::optional<plan::Hardware> machine;
  if (!o.machine.empty()) machine = plan::load_hardware(o.machine);
  if (fs::is_directory(o.path))
    in = read_run_dir(o.path);
  else
    in.trace = o.path;
  const auto spans = profile::read_chrome_trace(in.trace);
  const auto analysis = profile::analyse_trace(spans, o.skip_steps);
  std::set<int> ranks;
  for (const auto& r : analysis.ranks) ranks.insert(r.rank);
  const double n_ranks = static_cast<double>(ranks.size());

  // The roofline of one rank: flags, else the machine file, else the run's own peak and a bandwidth
  // measured now. The ranks of a job on one machine share its memory bandwidth.
  profile::Roofline roof;
  std::vector<std::string> sources;
  if (!o.machine.empty()) {
    roof.peak_flops = machine->peak(in.precision) / n_ranks;
    roof.bandwidth = machine->device.memory_bandwidth / n_ranks;
    sources.push_back("machine file " + o.machine + ", shared by " + std::to_string(ranks.size()) + " rank(s)");
  } else {
    roof.peak_flops = in.peak_flops;
    if (roof.peak_flops > 0) sources.push_back("peak measured by the run");
  }
  if (o.peak_flops > 0) roof.peak_flops = o.peak_flops, sources.push_back("--peak-flops");
  if (o.bandwidth > 0) {
    roof.bandwidth = o.bandwidth;
    sources.push_back("--bandwidth");
  } else if (roof.bandwidth <= 0) {
    roof.bandwidth = kernels::stream_triad_bandwidth(size_t{256} << 20, 3) / n_ranks;
    sources.push_back(fmt::format("bandwidth measured now (STREAM triad), shared by {} rank(s)", ranks.size()));
  }
  if (roof.peak_flops <= 0)
    throw ConfigError("no peak FLOP/s to place kernels against: give the run's directory (its manifest has the peak), "
                      "--machine FILE (loom calibrate) or --peak-flops");
  for (size_t i = 0; i < sources.size(); ++i) roof.source += (i ? "; " : "") + sources[i];
  const auto report = profile::build_report(analysis, roof, in.facts);
  // The planner's prediction beside the measurement needs the run's config: only a run directory has it.
  std::optional<RunPrediction> prediction;
  if (in.config) prediction = predict_run(*in.config, static_cast<int>(ranks.size()), machine, report);
  const std::string prediction_text =
      prediction ? format_run_prediction(*prediction)
                 : "\nplanner: no prediction for a bare trace; give the run's directory (its config names the layout)\n";
  if (!o.html.empty()) {
    std::ofstream out(o.html);
    out << profile::html_report(report, spans, o.path, {{"The planner's prediction", prediction_text}});
    if (!out) throw IoError("cannot write the HTML report '" + o.html + "': check the folder exists and is writable");
  }
  if (o.json) {
    auto j = profile::report_json(report);
    if (prediction) j["planner"] = run_prediction_json(*prediction);
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "loom profile report: " << in.trace << "\n"
              << profile::format_report(report) << prediction_text
              << (o.html.empty() ? "" : "HTML report written to " + o.html + "\n");
  }
  return 0;
}

// The flight records a failed multi-rank run left in RUN_DIR/flight (one file per rank).
int run_hang(const std::string& dir) {
  const fs::path flight = fs::path(dir) / "flight";
  std::vector<nlohmann::json> dumps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(flight, ec)) {
    if (e.path().extension() != ".json") continue;
    std::ifstream in(e.path());
    try {
      dumps.push_back(nlohmann::json::parse(in));
    } catch (const nlohmann::json::exception& ex) {
      throw IoError("'" + e.path().string() + "' is not JSON (" + ex.what() + ")");
    }
  }
  if (dumps.empty())
    throw IoError("no flight records in '" + flight.string() +
                  "': every rank of a multi-rank run writes its group's last ops there when the run fails");
  std::cout << "loom profile hang: " << dumps.size() << " rank(s) left flight records in " << flight.string() << "\n"
            << comm::format_hang(comm::analyse_hang(dumps));
  return 0;
}

}  // namespace

void register_profile(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("profile", "Analyse a traced run: what bounds a step and where the fix belongs");
  cmd->require_subcommand(1);
  auto o = std::make_shared<ProfileOptions>();
  auto* report = cmd->add_subcommand(
      "report", "Per rank and for the job: compute, communication (exposed, overlapped), pipeline waits, host; each "
                "kernel against the roofline; MFU/HFU; a verdict and the largest opportunities");
  report->add_option("path", o->path, "a run's train.out_dir (its manifest names the trace) or a trace JSON file")
      ->required();
  report->add_option("--machine", o->machine, "hardware TOML from `loom calibrate` for the roofline");
  report->add_option("--peak-flops", o->peak_flops, "one rank's peak FLOP/s (overrides the run's and the machine's)")
      ->check(finite_range(1, 1e20));  // 0 was taken as "not given", silently
  report->add_option("--bandwidth", o->bandwidth, "one rank's memory bandwidth, bytes/s (default: measured now)")
      ->check(finite_range(1, 1e16));
  report->add_option("--skip-steps", o->skip_steps, "steps of each rank left out at the start (warm-up)")
      ->check(finite_range(0, 1e9));
  report->add_flag("--json", o->json, "print the report as JSON");
  report->add_option("--html", o->html,
                     "also write the report as one self-contained HTML page (timeline, breakdown, roofline, verdict)");
  report->callback([&action, o] { action = [o] { return run_report(*o); }; });
  auto hang_dir = std::make_shared<std::string>();
  auto* hang = cmd->add_subcommand(
      "hang", "After a multi-rank run failed or hung: the collective each group did not complete, who waited in it "
              "and who never joined, from the flight records every rank left in RUN_DIR/flight");
  hang->add_option("run_dir", *hang_dir, "the run's train.out_dir")->required();
  hang->callback([&action, hang_dir] { action = [hang_dir] { return run_hang(*hang_dir); }; });
}

}  // namespace loom::cli
