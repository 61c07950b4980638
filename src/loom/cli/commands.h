// Each `loom` subcommand registers itself on the CLI11 app; main() dispatches and turns errors into
// one line on stderr and a non-zero exit.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace loom::cli {

using Action = std::function<int()>;

// Returns the action to run if the subcommand was chosen.
void register_train(CLI::App& app, Action& action);
void register_info(CLI::App& app, Action& action);
void register_generate(CLI::App& app, Action& action);
void register_interchange(CLI::App& app, Action& action);  // export + import
void register_plan(CLI::App& app, Action& action);
void register_prepare(CLI::App& app, Action& action);
void register_calibrate(CLI::App& app, Action& action);
void register_run(CLI::App& app, Action& action);         // the launcher
void register_bench(CLI::App& app, Action& action);       // bench comm
void register_verify(CLI::App& app, Action& action);      // layout invariance

// Threads per rank: LOOM_THREADS, else `configured` if > 0, else the node's cores divided among the
// `ranks_on_node` ranks of the job.
int resolve_threads(int configured, int ranks_on_node = 1);

// This binary's path (from /proc/self/exe), or "" if it cannot be read: commands that launch `loom`
// again (run, verify) start the same build, whatever is on PATH.
std::string self_executable();

}  // namespace loom::cli
