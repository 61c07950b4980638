// Each `loom` subcommand registers itself on the CLI11 app; main() dispatches and turns errors into
// one line on stderr and a non-zero exit.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>

namespace loom::cli {

using Action = std::function<int()>;

// Returns the action to run if the subcommand was chosen.
void register_train(CLI::App& app, Action& action);
void register_info(CLI::App& app, Action& action);
void register_generate(CLI::App& app, Action& action);
void register_interchange(CLI::App& app, Action& action);  // export + import
// `loom export`'s work (also `loom ckpt convert --to hf`): a checkpoint's weights as Hugging Face files.
int run_export(const std::string& checkpoint, const std::string& out, const std::string& format, const std::string& dtype);
void register_plan(CLI::App& app, Action& action);
void register_prepare(CLI::App& app, Action& action);
void register_calibrate(CLI::App& app, Action& action);
void register_run(CLI::App& app, Action& action);         // the launcher
void register_bench(CLI::App& app, Action& action);       // bench comm, bench gemm
void register_bench_gemm(CLI::App& bench, Action& action);  // `loom bench gemm`, under register_bench
void register_verify(CLI::App& app, Action& action);      // layout invariance
void register_profile(CLI::App& app, Action& action);     // profile report
void register_ckpt(CLI::App& app, Action& action);        // ckpt inspect

// A numeric flag's accepted values: finite (CLI::Range lets nan and inf through) and in [lo, hi].
inline CLI::Validator finite_range(double lo, double hi) {
  auto show = [](double v) {
    std::ostringstream s;
    s.precision(15);
    s << v;
    return s.str();
  };
  const std::string range = "[" + show(lo) + ", " + show(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        double v = 0;
        size_t used = 0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          return "'" + text + "' is not a number";
        }
        if (used != text.size()) return "'" + text + "' is not a number";
        if (!std::isfinite(v) || v < lo || v > hi) return text + " is out of range: it must be a finite number in " + range;
        return "";
      },
      "in " + range);
}

// Threads per rank: LOOM_THREADS, else `configured` if > 0, else the node's cores divided among the
// `ranks_on_node` ranks of the job.
int resolve_threads(int configured, int ranks_on_node = 1);

// This binary's path (from /proc/self/exe), or "" if it cannot be read: commands that launch `loom`
// again (run, verify) start the same build, whatever is on PATH.
std::string self_executable();

}  // namespace loom::cli
