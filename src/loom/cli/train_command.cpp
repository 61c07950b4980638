// `loom train`: train a model from a TOML config plus --set overrides, with a progress line, a
// JSON-lines metrics log, a run manifest, an optional Chrome trace and a time breakdown at the end.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "loom/cli/commands.h"
#include "loom/cli/run_prediction.h"
#include "loom/comm/job_env.h"
#include "loom/error.h"
#include "loom_git_commit.h"  // generated at build time (cmake/git_commit.cmake)
#include "loom/plan/engine_memory.h"
#include "loom/spec/pipeline_schedule.h"
#include "loom/spec/pipeline_stages.h"
#include "loom/train/session.h"

namespace loom::cli {

namespace {

struct TrainOptions {
  std::string config;
  std::vector<std::string> sets;
  std::string trace;
  bool quiet = false;
  bool json = false;
  std::optional<int64_t> save_every;
  std::string save_dir;
  std::optional<int64_t> keep;
  bool resume = false;
  int64_t check_replicas = 0;
  std::string resume_from;
};

// Refuses a run whose ranks on this node would need more memory than the machine has, before anything
// is allocated: the planner's model of the engine's own buffers (exact to the byte, tested against
// measured runs) for the layout asked.
void check_fits_in_memory(const train::RunConfig& cfg, int ranks_on_node) {
  const plan::Layout l = layout_of(cfg);
  plan::EnginePipeline pipe{cfg.train.batch_size / (cfg.parallel.dp * cfg.micro_batch()),
                            spec::parse_layer_counts(cfg.parallel.pipeline_layers, "parallel.pipeline.layers"),
                            cfg.parallel.pipeline_bf16_transfers};
  // The heaviest pipeline stage decides (the first holds the embeddings, the last the logits).
  plan::EngineMemory need;
  for (int stage = 0; stage < l.pp; ++stage) {
    const auto m = plan::loom_engine_memory(cfg.model.resolved, l, cfg.seq_len(),
                                            {cfg.precision == model::Precision::BF16, cfg.pure_bf16}, pipe, stage);
    if (m.total() > need.total()) need = m;
  }
  const double have = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  const double gib = 1024.0 * 1024.0 * 1024.0;
  if (have > 0 && need.total() * ranks_on_node > have)
    throw ConfigError(fmt::format(
        "this run needs {:.1f} GiB per rank (parameters {:.1f}, gradients {:.1f}, optimizer {:.1f}, activations {:.1f}) "
        "x {} rank(s) on this node, but the machine has {:.1f} GiB: lower the model's size, train.micro_batch_size or "
        "train.seq_len, or shard the state (parallel.zero = 3 over more ranks)",
        need.total() / gib, need.parameters / gib, need.gradients / gib, need.optimizer / gib, need.activations / gib,
        ranks_on_node, have / gib));
}

// Prints what a Session reports on stderr: on a terminal the progress line is a status line that the
// next one overwrites; elsewhere (a log file) every line stays.
class TerminalReporter final : public train::SessionReporter {
 public:
  explicit TerminalReporter(bool quiet) : quiet_(quiet), tty_(isatty(STDERR_FILENO)) {}
  void note(const std::string& line) override {
    if (quiet_) return;
    fmt::print(stderr, "{}{}\n", pending_ ? "\r\033[K" : "", line);
    pending_ = false;
  }
  void progress(const std::string& line, bool keep) override {
    if (quiet_) return;
    keep = keep || !tty_;
    fmt::print(stderr, "{}{}{}", tty_ ? "\r\033[K" : "", line, keep ? "\n" : "");
    pending_ = !keep;
  }
  bool wants_progress() const override { return !quiet_; }

 private:
  bool quiet_, tty_;
  bool pending_ = false;  // a status line is on the terminal without its newline
};

int run_train(const TrainOptions& o) {
  // Numeric flags are overrides of their config keys, so the registry's ranges apply to them too.
  std::vector<std::string> sets = o.sets;
  if (o.save_every) sets.push_back(fmt::format("checkpoint.save_every={}", *o.save_every));
  if (o.keep) sets.push_back(fmt::format("checkpoint.keep={}", *o.keep));
  train::RunConfig cfg = o.config.empty() ? train::parse_run_config("", "<defaults>", sets)
                                          : train::load_run_config(o.config, sets);
  if (!o.trace.empty()) cfg.trace.file = o.trace;
  if (!o.save_dir.empty()) cfg.checkpoint.dir = o.save_dir;
  cfg.validate();
  const comm::JobEnv job = comm::read_job_env();
  check_fits_in_memory(cfg, job.local_world_size);

  train::SessionOptions so;
  so.resume = o.resume;
  so.resume_from = o.resume_from;
  so.check_replicas = o.check_replicas;
  so.threads = resolve_threads(cfg.train.threads, job.local_world_size);
  so.version = LOOM_VERSION;
  so.commit = LOOM_GIT_COMMIT;
  TerminalReporter out(o.quiet);
  const train::SessionSummary sum = train::Session(cfg, so, out).run();
  if (o.json && sum.lead && !sum.already_complete) {
    nlohmann::json j{{"framework", "loom"},         {"preset", cfg.model.preset},
                     {"precision", cfg.precision_label()},
                     {"recompute", spec::recompute_name(cfg.train.recompute)},
                     {"threads", sum.threads},      {"tokens_per_s", sum.tokens_per_s},
                     {"mfu", sum.mfu},              {"hfu", sum.hfu},
                     {"final_loss", sum.final_loss}, {"steps", cfg.train.steps},
                     {"last_step", sum.last_step},  {"peak_flops", sum.peak_flops},
                     {"peak_bytes", sum.peak_bytes}};
    if (sum.val_loss) j["val_loss"] = *sum.val_loss;
    j["skipped_steps"] = sum.skipped_steps;
    // A preempted run says so: what stopped it and the step its checkpoint holds.
    j["stopped_by"] = sum.stop_signal != 0 ? nlohmann::json(sum.stopped_by) : nlohmann::json(nullptr);
    if (sum.saved_step > 0) j["saved_step"] = sum.saved_step;
    // Rank 0's peak bytes by category (under ZeRO its shards; a checkpoint save adds the gathered
    // moments, and under ZeRO-3 the gathered weights, for its duration).
    for (const auto& [cat, bytes] : sum.peak_bytes_by_category) j["peak_bytes_by_category"][cat] = bytes;
    for (const auto& [cat, bytes] : sum.live_bytes_by_category) j["live_bytes_by_category"][cat] = bytes;
    if (sum.on_demand_resident_bytes) j["on_demand_resident_bytes"] = *sum.on_demand_resident_bytes;
    if (!sum.peak_bytes_by_rank.empty()) j["peak_bytes_by_rank"] = sum.peak_bytes_by_rank;
    if (const auto& b = sum.pipeline)
      j["pipeline"] = {{"schedule", b->schedule}, {"idle_by_stage", b->idle}, {"bubble_theory", b->theory}};
    if (const auto& t = sum.step_split)
      j["step_split_ms"] = {{"wall", 1e3 * t->wall},           {"gemm", 1e3 * t->gemm},
                            {"other_kernels", 1e3 * t->kernels}, {"comm_exposed", 1e3 * t->comm_exposed},
                            {"comm_in_flight", 1e3 * t->comm_in_flight}, {"comm_hidden", 1e3 * t->comm_hidden},
                            {"host", 1e3 * t->host}};
    fmt::print("{}\n", j.dump());
  }
  return sum.exit_status();
}

}  // namespace

void register_train(CLI::App& app, Action& action) {
  auto o = std::make_shared<TrainOptions>();
  auto* cmd = app.add_subcommand("train", "Train a model from a TOML config");
  cmd->add_option("-c,--config", o->config, "TOML config (configs/*.toml); without it the defaults below apply")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", o->sets, "override a config key, e.g. --set train.lr=3e-4 (repeatable)");
  cmd->add_option("--trace", o->trace, "write a Chrome/Perfetto trace JSON of every kernel to this file");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress output (the metrics log is still written)");
  cmd->add_flag("--json", o->json, "print a one-line JSON summary on stdout at the end");
  cmd->add_option("--save-every", o->save_every, "checkpoint every N steps (checkpoint.save_every)");
  cmd->add_option("--save-dir", o->save_dir, "checkpoint directory (checkpoint.dir)");
  cmd->add_option("--keep", o->keep, "keep only this run's newest K checkpoints (checkpoint.keep)");
  cmd->add_option("--check-replicas", o->check_replicas,
                  "every N steps, check that data-parallel replicas hold bitwise-identical weights and optimizer "
                  "state, naming the first rank that drifted (0: never)")
      ->check(finite_range(0, 1099511627776.0));
  cmd->add_flag("--resume", o->resume, "continue the run in checkpoint.dir from its latest checkpoint");
  cmd->add_option("--resume-from", o->resume_from, "continue from this checkpoint (a step-N folder or checkpoint dir)");
  cmd->footer("Config keys (TOML tables; --set uses the dotted names):\n" + train::config_reference());
  cmd->callback([&action, o] { action = [o] { return run_train(*o); }; });
}

}  // namespace loom::cli
