// `loom verify`: layout invariance, checked. Trains the same config (seed, data) under each parallel
// layout for K steps, each as its own job (`loom run -n <ranks> -- loom train ...`), and compares every
// step's loss with the first layout's. A layout that changes the numbers beyond rounding is a bug.
// `--numerics` compares precisions the same way (same layout, seed and data), against a bar on the final
// validation loss, and plots the curves side by side.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/cli/commands.h"
#include "loom/cli/loss_plot.h"
#include "loom/core/output_folder.h"
#include "loom/error.h"
#include "loom/train/run_config.h"

namespace loom::cli {

namespace {

namespace fs = std::filesystem;

struct VerifyArgs {
  std::string config;
  std::vector<std::string> sets;
  std::string layouts = "dp=1;dp=2";
  int64_t steps = 10;
  double tolerance = 0;  // 0: by precision (fp32 1e-5, bf16 1e-2); --numerics: 0.01
  bool keep = false;
  // --numerics: the config's own layout trained once per precision, compared with the first.
  bool numerics = false;
  std::string precisions = "fp32;bf16;bf16-sr";
  std::string plot;  // SVG of the loss curves
};

struct Layout {
  std::string text;               // as the user wrote it
  std::vector<std::string> sets;  // parallel.<key>=<value>
  int ranks = 1;
};

// "dp=4,zero=1" -> {parallel.dp=4, parallel.zero=1}; "tp=2,sp=1" -> {parallel.tp=2,
// parallel.sequence_parallel=true}; "pp=2,v=2,schedule=interleaved-1f1b" -> the pipeline keys;
// ranks = dp * tp * pp * cp.
std::vector<Layout> parse_layouts(const std::string& spec) {
  std::vector<Layout> out;
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t end = std::min(spec.find(';', start), spec.size());
    std::string item = spec.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    Layout l{item, {}, 1};
    size_t s = 0;
    while (s <= item.size()) {
      const size_t e = std::min(item.find(',', s), item.size());
      const std::string kv = item.substr(s, e - s);
      s = e + 1;
      if (kv.empty()) continue;
      const auto eq = kv.find('=');
      const std::string key = kv.substr(0, eq);
      const std::string value = eq == std::string::npos ? "" : kv.substr(eq + 1);
      static const std::vector<std::string> known = {"dp", "tp",      "pp", "cp",       "cp_mode", "ep",       "zero",
                                                     "bucket_kb", "sp", "overlap", "v",  "schedule", "layers", "recompute"};
      if (eq == std::string::npos || std::find(known.begin(), known.end(), key) == known.end())
        throw ConfigError(
            fmt::format("--layouts: '{}' in '{}' is not key=value with a key of dp, tp, pp, cp, cp_mode, ep, zero, "
                        "bucket_kb, sp, overlap, v, schedule, layers, recompute (e.g. --layouts "
                        "\"dp=1;dp=2;tp=2,sp=1;pp=2,v=2,schedule=interleaved-1f1b;pp=2,layers=1/3;cp=2,cp_mode=all-to-all\")",
                        kv, item));
      // The pipeline schedule, the recompute policy and the cp mode are names; every other key a number.
      if (key == "schedule" || key == "recompute" || key == "cp_mode") {
        l.sets.push_back((key == "schedule"    ? "parallel.pipeline.schedule="
                          : key == "cp_mode" ? "parallel.cp_mode="
                                             : "train.recompute=") +
                         value);
        continue;
      }
      // An explicit pipeline cut, blocks per chunk separated by '/' (',' separates keys here).
      if (key == "layers") {
        std::string list = value;
        std::replace(list.begin(), list.end(), '/', ',');
        // Quoted: a single count ("layers=3") would otherwise read as a TOML integer, and the error would
        // be about the key's type instead of the cut.
        l.sets.push_back("parallel.pipeline.layers=\"" + list + "\"");
        continue;
      }
      char* endp = nullptr;
      const long v = std::strtol(value.c_str(), &endp, 10);
      if (value.empty() || *endp != '\0' || v < 0 || v > 65536)
        throw ConfigError(fmt::format("--layouts: {} = '{}' in '{}' is not a non-negative integer", key, value, item));
      if (key == "dp" || key == "tp" || key == "pp" || key == "cp") l.ranks *= std::max<long>(v, 1);
      // sp and overlap are switches: 1 on, 0 off.
      if (key == "sp" || key == "overlap") {
        if (v > 1) throw ConfigError(fmt::format("--layouts: {} = {} in '{}' must be 0 or 1", key, value, item));
        l.sets.push_back(std::string(key == "sp" ? "parallel.sequence_parallel=" : "parallel.tp_overlap=") +
                         (v ? "true" : "false"));
        continue;
      }
      l.sets.push_back(key == "v" ? "parallel.pipeline.virtual_stages=" + value : "parallel." + key + "=" + value);
    }
    out.push_back(std::move(l));
  }
  if (out.size() < 2) throw ConfigError("--layouts needs at least two layouts separated by ';' (e.g. \"dp=1;dp=2\")");
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct Curves {
  std::vector<double> loss;                     // every step's training loss (NaN where not finite)
  std::vector<std::pair<int64_t, double>> val;  // (step, validation loss) where validation ran
};

Curves read_curves(const fs::path& metrics) {
  Curves c;
  std::ifstream f(metrics);
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    const auto& l = j.at("loss");
    c.loss.push_back(l.is_number() ? l.get<double>() : std::nan(""));
    if (j.contains("val_loss") && j["val_loss"].is_number())
      c.val.emplace_back(j.at("step").get<int64_t>(), j["val_loss"].get<double>());
  }
  return c;
}

// Trains the config with `sets` added as its own job (`loom run -n ranks -- loom train ...`) into
// work/<name>; the log goes to work/<name>.log. Returns the exit status.
int run_job(const VerifyArgs& a, const std::vector<std::string>& sets, int ranks, const fs::path& work,
            const std::string& name) {
  const std::string self = self_executable();
  const std::string loom = self.empty() ? "loom" : self;
  const fs::path out = work / name;
  std::string cmd = shell_quote(loom) + " run -n " + std::to_string(ranks) + " -- " + shell_quote(loom) + " train";
  if (!a.config.empty()) cmd += " --config " + shell_quote(a.config);
  for (const auto& s : a.sets) cmd += " --set " + shell_quote(s);
  for (const auto& s : sets) cmd += " --set " + shell_quote(s);
  cmd += fmt::format(" --set train.steps={} --set checkpoint.save_every=0 --set train.out_dir={} --save-dir {} --quiet",
                     a.steps, shell_quote(out.string()), shell_quote((out / "ck").string()));
  cmd += " > " + shell_quote((work / (name + ".log")).string()) + " 2>&1";
  return std::system(cmd.c_str());
}

std::string read_log(const fs::path& work, const std::string& name) {
  std::ifstream log(work / (name + ".log"));
  return std::string((std::istreambuf_iterator<char>(log)), {});
}

// --numerics: the config's own layout once per precision; each curve against the first precision's.
// The bar is on the final validation loss (the final training loss when validation never ran).
int verify_numerics(const VerifyArgs& a) {
  if (!a.plot.empty()) check_output_file(a.plot, "--plot");  // before the runs, not after
  std::vector<std::string> precisions;
  for (size_t start = 0; start <= a.precisions.size();) {
    const size_t end = std::min(a.precisions.find(';', start), a.precisions.size());
    if (end > start) precisions.push_back(a.precisions.substr(start, end - start));
    start = end + 1;
  }
  if (precisions.size() < 2)
    throw ConfigError("--precisions needs at least two precisions separated by ';' (e.g. \"fp32;bf16;bf16-sr\")");
  if (a.steps < 1) throw ConfigError("--steps must be at least 1");
  train::RunConfig cfg;
  for (const auto& p : precisions) {
    auto sets = a.sets;
    sets.push_back("precision=" + p);
    try {
      cfg = a.config.empty() ? train::parse_run_config("", "<defaults>", sets) : train::load_run_config(a.config, sets);
      cfg.validate();
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("--precisions: '{}': {}", p, e.what()));
    }
  }
  const int ranks = static_cast<int>(cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp);
  const double tol = a.tolerance > 0 ? a.tolerance : 0.01;
  const fs::path work = fs::temp_directory_path() / fmt::format("loom-verify-{}", ::getpid());
  fs::remove_all(work);
  fs::create_directories(work);
  fmt::print(
      "loom verify --numerics: {} precisions x {} steps, {} on {} rank(s); bar: final validation loss within "
      "{:g} (relative) of {}'s\n",
      precisions.size(), a.steps, cfg.model.preset, ranks, tol, precisions.front());
  fmt::print("{:<12} {:>11} {:>11} {:>15} {:>13} {:>11}  {}\n", "precision", "final loss", "final val", "mean |diff|",
             "max rel diff", "val diff", "");
  std::vector<LossSeries> series;
  double ref_final = 0;
  bool all_pass = true;
  for (size_t i = 0; i < precisions.size(); ++i) {
    const std::string name = "p" + std::to_string(i);
    const int status = run_job(a, {"precision=" + precisions[i]}, ranks, work, name);
    const Curves c = read_curves(work / name / "metrics.jsonl");
    if (status != 0 || c.loss.size() != static_cast<size_t>(a.steps)) {
      fmt::print("{:<12} {:>11} {:>11} {:>15} {:>13} {:>11}  FAIL (the run did not complete)\n{}", precisions[i], "-",
                 "-", "-", "-", "-", read_log(work, name));
      all_pass = false;
      if (i == 0) break;
      continue;
    }
    series.push_back({precisions[i], c.loss, c.val});
    const bool has_val = !c.val.empty();
    const double final_val = has_val ? c.val.back().second : c.loss.back();
    if (i == 0) ref_final = final_val;
    // Relative differences of the training curve against the first precision's, step by step.
    double sum = 0, worst = 0;
    for (size_t k = 0; k < c.loss.size(); ++k) {
      const double ref = series.front().loss[k];
      const double d = std::abs(c.loss[k] - ref) / std::max(std::abs(ref), 1e-12);
      sum += std::isfinite(d) ? d : 0;
      worst = std::isfinite(d) ? std::max(worst, d) : INFINITY;
    }
    const double val_diff = (final_val - ref_final) / std::max(std::abs(ref_final), 1e-12);
    const bool pass = std::abs(val_diff) <= tol;
    all_pass = all_pass && pass;
    fmt::print("{:<12} {:>11.4f} {:>11} {:>14.3f}% {:>12.3f}% {:>+10.3f}%  {}\n", precisions[i], c.loss.back(),
               has_val ? fmt::format("{:.4f}", final_val) : std::string("(train)"),
               100 * sum / static_cast<double>(c.loss.size()), 100 * worst, 100 * val_diff,
               i == 0 ? "(reference)"
               : pass ? "PASS"
                      : "FAIL");
  }
  if (!a.plot.empty()) {
    std::ofstream f(a.plot);
    f << loss_curves_svg(fmt::format("{}: loss by precision, {} steps", cfg.model.preset, a.steps), series);
    if (!f) throw IoError("cannot write the plot '" + a.plot + "'");
    fmt::print("loss curves written to {}\n", a.plot);
  }
  if (!a.keep)
    fs::remove_all(work);
  else
    fmt::print("runs kept in {}\n", work.string());
  fmt::print("{}\n",
             all_pass ? "every precision within the bar" : "precisions DIFFER beyond the bar (or failed to run)");
  return all_pass ? 0 : 1;
}

int verify(const VerifyArgs& a) {
  if (a.numerics) return verify_numerics(a);
  const auto layouts = parse_layouts(a.layouts);
  if (a.steps < 1) throw ConfigError("--steps must be at least 1");
  // The config must load before any job starts: a typo fails here, once.
  train::RunConfig cfg =
      a.config.empty() ? train::parse_run_config("", "<defaults>", a.sets) : train::load_run_config(a.config, a.sets);
  // Every layout must be valid before the first job starts (batch divisibility, supported degrees).
  for (const auto& l : layouts) {
    auto sets = a.sets;
    sets.insert(sets.end(), l.sets.begin(), l.sets.end());
    try {
      train::RunConfig c =
          a.config.empty() ? train::parse_run_config("", "<defaults>", sets) : train::load_run_config(a.config, sets);
      c.validate();
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("layout '{}': {}", l.text, e.what()));
    }
  }
  const double tol = a.tolerance > 0 ? a.tolerance : cfg.precision == model::Precision::BF16 ? 1e-2 : 1e-5;
  const fs::path work = fs::temp_directory_path() / fmt::format("loom-verify-{}", ::getpid());
  fs::remove_all(work);
  fs::create_directories(work);

  fmt::print("loom verify: {} layouts x {} steps, {} {}, tolerance {:g} (relative loss difference vs the first)\n",
             layouts.size(), a.steps, cfg.model.preset, cfg.precision_label(), tol);
  fmt::print("{:<24} {:>6} {:>12} {:>14} {:>8}  {}\n", "layout", "ranks", "final loss", "max rel diff", "worst at", "");
  std::vector<double> base;
  bool all_pass = true;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const Layout& l = layouts[i];
    const int status = run_job(a, l.sets, l.ranks, work, std::to_string(i));
    const auto losses = read_curves(work / std::to_string(i) / "metrics.jsonl").loss;
    if (status != 0 || losses.size() != static_cast<size_t>(a.steps)) {
      fmt::print("{:<24} {:>6} {:>12} {:>14} {:>8}  FAIL (the run did not complete)\n{}", l.text, l.ranks, "-", "-",
                 "-", read_log(work, std::to_string(i)));
      all_pass = false;
      if (i == 0) break;  // nothing to compare against
      continue;
    }
    if (i == 0) base = losses;
    double worst = 0;
    size_t worst_step = 0;
    for (size_t s = 0; s < losses.size(); ++s) {
      const double d = std::abs(losses[s] - base[s]) / std::max(std::abs(base[s]), 1e-12);
      if (d > worst || std::isnan(d)) worst = d, worst_step = s + 1;
    }
    const bool pass = worst <= tol;
    all_pass = all_pass && pass;
    fmt::print("{:<24} {:>6} {:>12.6f} {:>14.3e} {:>8}  {}\n", l.text, l.ranks, losses.back(), worst,
               i == 0 ? std::string("-") : fmt::format("step {}", worst_step),
               i == 0 ? "(reference)"
               : pass ? "PASS"
                      : "FAIL");
  }
  if (!a.keep)
    fs::remove_all(work);
  else
    fmt::print("runs kept in {}\n", work.string());
  fmt::print("{}\n", all_pass ? "all layouts agree" : "layouts DISAGREE (or failed to run)");
  return all_pass ? 0 : 1;
}

}  // namespace

void register_verify(CLI::App& app, Action& action) {
  auto a = std::make_shared<VerifyArgs>();
  auto* cmd = app.add_subcommand("verify", "Check that parallel layouts reproduce the same loss curve");
  cmd->add_option("-c,--config", a->config, "TOML config (as for loom train)")->check(CLI::ExistingFile);
  cmd->add_option("--set", a->sets, "key=value overrides (as for loom train)");
  cmd->add_option("--layouts", a->layouts,
                  "layouts separated by ';', keys by ',' (default \"dp=1;dp=2\"), "
                  "e.g. \"dp=1;dp=2;tp=2,sp=1;dp=4,zero=1;pp=2,recompute=full\" (keys dp tp pp cp ep zero "
                  "bucket_kb v, sp and overlap 0/1, schedule, layers 1/3, recompute none|selective|full, cp_mode ring|all-to-all); "
                  "the first is the reference");
  cmd->add_option("--steps", a->steps, "steps per layout (default 10: past warm-up)");
  // 0, negative and NaN were taken as "not given" and replaced by the default, silently.
  cmd->add_option("--tolerance", a->tolerance,
                  "largest relative loss difference allowed (default fp32 1e-5, bf16 1e-2; with --numerics, on the "
                  "final validation loss, 0.01)")
      ->check(finite_range(1e-30, 1e6));
  cmd->add_flag("--keep", a->keep, "keep each run's folder (metrics, log) for inspection");
  cmd->add_flag("--numerics", a->numerics,
                "compare precisions instead of layouts: the config's own layout trained once per --precisions entry, "
                "each against the first (bar: --tolerance on the final validation loss, default 0.01)");
  cmd->add_option("--precisions", a->precisions,
                  "with --numerics: precisions separated by ';' (default \"fp32;bf16;bf16-sr\")");
  cmd->add_option("--plot", a->plot, "with --numerics: write the loss curves side by side to this SVG file");
  cmd->callback([&action, a] { action = [a] { return verify(*a); }; });
}

}  // namespace loom::cli
