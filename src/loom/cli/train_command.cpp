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
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/peak_probe.h"
#include "loom/error.h"
#include "loom/comm/world.h"
#include "loom/parallel/mesh.h"
#include "loom/parallel/trace_merge.h"
#include "loom/plan/engine_memory.h"
#include "loom/train/checkpoint.h"
#include "loom/train/preemption.h"
#include "loom/train/rank_agreement.h"
#include "loom/train/run_log.h"
#include "loom/train/trainer.h"

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

std::string duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Refuses a run whose ranks on this node would need more memory than the machine has, before anything
// is allocated: the planner's model of the engine's own buffers (exact to the byte, tested against
// measured runs) for the layout asked.
void check_fits_in_memory(const train::RunConfig& cfg, int ranks_on_node) {
  plan::Layout l;
  l.dp = static_cast<int>(cfg.parallel.dp);
  l.zero = static_cast<int>(cfg.parallel.zero);
  l.micro_batch = static_cast<int>(cfg.micro_batch());
  const auto need = plan::loom_engine_memory(cfg.model.resolved, l, cfg.seq_len(), cfg.precision == model::Precision::BF16);
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
  // A multi-rank job (loom run, mpirun, srun): join it and lay the ranks out on the mesh. Rank 0 speaks,
  // logs and saves; the replicas it stands for hold the same state.
  const comm::JobEnv job = comm::read_job_env();
  const parallel::MeshShape shape{static_cast<int>(cfg.parallel.pp), static_cast<int>(cfg.parallel.dp),
                                  static_cast<int>(cfg.parallel.cp), static_cast<int>(cfg.parallel.tp)};
  parallel::validate_mesh(shape, job.world_size);  // before any work: the layout must fit the job
  check_fits_in_memory(cfg, job.local_world_size);
  Allocator alloc;
  std::unique_ptr<comm::World> world;
  std::unique_ptr<parallel::Mesh> mesh;
  if (job.world_size > 1) {
    world = comm::World::join(job, comm::comm_options_from_env(comm::current_environment()), &alloc);
    mesh = std::make_unique<parallel::Mesh>(shape, *world);
  }
  const bool lead = job.rank == 0;
  const bool quiet = o.quiet || !lead;
  const int threads = resolve_threads(cfg.train.threads, job.local_world_size);
  const bool tty = isatty(STDERR_FILENO);
  auto say = [&](const std::string& line) {
    if (!quiet) fmt::print(stderr, "{}\n", line);
  };

  profile::Tracer tracer(!cfg.trace.file.empty() ? profile::Tracer::Mode::Full
                         : cfg.trace.summary    ? profile::Tracer::Mode::Summary
                                                : profile::Tracer::Mode::Off,
                         job.rank);
  kernels::CpuBackend backend(alloc, &tracer, threads);
  train::RunIdentity id{LOOM_VERSION, LOOM_GIT_COMMIT, backend.describe(), threads, 0, ""};
  say(fmt::format("loom {} ({}) | {}", id.version, id.commit, id.backend));
  const auto& m = cfg.model.resolved;
  const auto table = spec::build_param_table(m);
  // Before any work: every rank runs the same build, config, model and layout (else one line naming what
  // differs, instead of replicas that silently diverge).
  if (world)
    train::check_ranks_agree(world->group(),
                             train::run_facts(cfg, table, world->size(), fmt::format("{} ({})", id.version, id.commit)),
                             "the run");
  say(fmt::format("model {} ({}): {:.2f} M parameters, L={} C={} H={} KV={} V={} | {} | batch {} x {} tokens (micro {})",
                  cfg.model.preset, spec::arch_name(m.arch), table.total_numel() * 1e-6, m.n_layers, m.d_model,
                  m.n_heads, m.n_kv_heads, m.vocab_size, model::precision_name(cfg.precision), cfg.train.batch_size,
                  cfg.seq_len(), cfg.micro_batch()));
  const DType peak_type = cfg.precision == model::Precision::BF16 ? DType::BF16 : DType::F32;
  auto peak = kernels::device_peak_flops(peak_type, threads);
  id.peak_flops = peak.flops_per_s;
  id.peak_source = peak.source;
  say(fmt::format("device peak {} GEMM {:.1f} GFLOP/s ({})", dtype_name(peak_type), peak.flops_per_s * 1e-9, peak.source));
  if (world)
    say(fmt::format("job: {} ranks ({}) on {} node(s), {} transport, mesh {}", world->size(),
                    comm::launcher_name(job.launcher), world->nodes(), world->group().transport_name(), shape.str()));

  const bool resuming_run = o.resume || !o.resume_from.empty();
  std::optional<train::MetricsLog> log;
  if (lead) {
    train::write_run_manifest(cfg.train.out_dir, cfg, id);
    log.emplace(cfg.train.out_dir, /*append=*/resuming_run);
  }
  train::Trainer trainer(cfg, backend, peak.flops_per_s, mesh ? mesh->group(spec::MeshAxis::DP) : nullptr);
  say("data: " + trainer.data().describe());
  if (world) train::check_ranks_agree(world->group(), train::data_facts(trainer.data()), "the data");
  if (o.check_replicas > 0 && trainer.zero_stage() == 3)
    say("note: --check-replicas has nothing to compare under parallel.zero = 3 (no state is replicated); skipped");
  const bool resuming = resuming_run;
  train::CheckpointManager checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep, resuming);
  if (resuming) {
    std::string from = !o.resume_from.empty() ? o.resume_from : checkpoints.latest().value_or("");
    if (from.empty())
      throw IoError("--resume: no checkpoint in '" + cfg.checkpoint.dir + "' (its `latest` file is missing); " +
                    "train without --resume, or point --resume-from at a checkpoint");
    auto report = train::load_checkpoint(from, trainer);
    say(fmt::format("resumed from {} at step {}", train::resolve_checkpoint(from), report.step));
    if (!report.changed_keys.empty()) {
      std::string keys;
      for (auto& k : report.changed_keys) keys += (keys.empty() ? "" : ", ") + k;
      say("note: these keys differ from the checkpoint's, so the run will not reproduce the original: " + keys);
    }
  }
  if (trainer.start_step() >= cfg.train.steps) {
    say(fmt::format("the run is already complete at step {} (train.steps = {}); raise train.steps to train further",
                    trainer.start_step(), cfg.train.steps));
    return 0;
  }
  train::install_preemption_handlers();
  int64_t last_saved = trainer.start_step(), last_step = trainer.start_step();

  std::vector<double> tps, mfus, exposed, comm_cpu, step_s;
  std::optional<double> last_val;
  double last_loss = 0;
  // The first steps pay for primitive creation and page faults; exclude them from the summary.
  const int64_t warmup = std::min<int64_t>(2, cfg.train.steps - 1);
  bool preempted = false;
  int stop_signal = 0;  // the signal that stopped the run, agreed by every rank
  trainer.run([&](const train::StepMetrics& s) {
    if (log) log->write(s);
    // The summary describes the last step that ran, also when a signal ends the run after it.
    last_step = s.step;
    last_loss = s.loss;
    if (s.val_loss) last_val = s.val_loss;
    if (o.check_replicas > 0 && s.step % o.check_replicas == 0) trainer.check_replicas(s.step);
    // Checkpoint at the step boundary: periodically, on preemption, and after the last step.
    const bool periodic = cfg.checkpoint.save_every > 0 && s.step % cfg.checkpoint.save_every == 0;
    const bool final = cfg.checkpoint.save_every > 0 && s.step == s.total_steps;
    stop_signal = train::preemption_signal();
    if (world) {
      // Ranks may see a signal at different steps: all stop after the same one, or the early ones would
      // leave the others waiting in the next step's collectives. The signal travels too, so every rank
      // reports (and exits with) the one that came.
      int32_t flag = stop_signal;
      world->group().all_reduce(&flag, &flag, 1, DType::I32, comm::ReduceOp::kMax).wait();
      stop_signal = flag;
    }
    preempted = stop_signal != 0;
    if (periodic || final || preempted) {
      // Replicas: rank 0's weights are everyone's; ZeRO moments (and ZeRO-3 weights) are first gathered.
      trainer.gather_full_state();
      if (lead) {
        std::string path = checkpoints.save(trainer, s.step);
        if (!quiet) fmt::print(stderr, "{}checkpoint saved: {}\n", tty ? "\r\033[K" : "", path);
      }
      trainer.release_full_state();
      // The others wait here, not in the next collective, for rank 0's write: a large checkpoint may
      // take longer than LOOM_COMM_TIMEOUT, which is sized for a hang, not for a save.
      if (world) world->group().barrier(comm::kSaveTimeout).wait();
    }
    if (periodic || final || preempted) last_saved = s.step;
    if (preempted) return false;
    if (s.step > warmup) {
      tps.push_back(s.tokens_per_s), mfus.push_back(s.mfu);
      exposed.push_back(s.exposed_comm_seconds), comm_cpu.push_back(s.comm_cpu_seconds), step_s.push_back(s.step_seconds);
    }
    if (s.step == warmup) tracer.reset_stats();
    if (quiet || (s.step % cfg.train.log_every != 0 && s.step != s.total_steps && !s.val_loss)) return true;
    double eta = (s.total_steps - s.step) * (s.elapsed_seconds / static_cast<double>(s.step - trainer.start_step()));
    std::string line = fmt::format("step {:>{}}/{} | loss {:.4f}{} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s | MFU {:.1f}% | ETA {}",
                                   s.step, std::to_string(s.total_steps).size(), s.total_steps, s.loss,
                                   s.val_loss ? fmt::format(" | val {:.4f}", *s.val_loss) : "", s.lr, s.grad_norm,
                                   s.tokens_per_s, 100.0 * s.mfu, duration(eta));
    const bool keep = !tty || s.val_loss || s.step == s.total_steps;
    fmt::print(stderr, "{}{}{}", tty ? "\r\033[K" : "", line, keep ? "\n" : "");
    return true;
  });
  const char* abbrev = preempted ? sigabbrev_np(stop_signal) : nullptr;
  const std::string stopped_by = !preempted ? "" : abbrev ? "SIG" + std::string(abbrev) : fmt::format("signal {}", stop_signal);
  if (preempted)
    say(fmt::format("stopped by {} after step {} of {}, saved as step {}; resume with --resume (checkpoint.dir = {})",
                    stopped_by, last_step, cfg.train.steps, last_saved, cfg.checkpoint.dir));

  double wall = 0;
  for (auto& [name, st] : tracer.stats())
    if (name == "step" || name == "eval") wall += st.seconds;
  const double med_tps = median(tps), med_mfu = median(mfus);
  double declared = 0;
  for (auto& [name, st] : tracer.stats())
    if (st.category == profile::Category::Gemm || st.category == profile::Category::Kernel) declared += st.flops;
  const double hfu = wall > 0 && peak.flops_per_s > 0 ? declared / wall / peak.flops_per_s : 0;
  say(fmt::format("{}: step {} | loss {:.4f}{} | median {:.0f} tok/s | MFU {:.1f}% | HFU {:.1f}% | peak memory {:.1f} MiB | log {}",
                  preempted ? "stopped" : "done", last_step, last_loss,
                  last_val ? fmt::format(" | val {:.4f}", *last_val) : "", med_tps, 100 * med_mfu, 100 * hfu,
                  alloc.total().peak / 1048576.0, log ? log->path() : std::string("(rank 0 writes it)")));
  if (world && !step_s.empty())
    say(fmt::format("data-parallel communication per step (median): exposed {:.1f} ms ({:.1f}% of the step), "
                    "communication CPU {:.1f} ms",
                    1e3 * median(exposed), 100 * median(exposed) / median(step_s), 1e3 * median(comm_cpu)));
  if (world) {
    // Every rank's memory, by category: at rest (live after the last step) and at peak. Rank 0 prints.
    std::vector<uint64_t> mine;
    for (int c = 0; c < kMemCategoryCount; ++c) {
      mine.push_back(alloc.stats(static_cast<MemCategory>(c)).live);
      mine.push_back(alloc.stats(static_cast<MemCategory>(c)).peak);
    }
    std::vector<uint64_t> all(mine.size() * static_cast<size_t>(world->size()));
    world->group().all_gather(mine.data(), all.data(), mine.size(), DType::I64).wait();
    std::string table = "memory per rank, MiB at rest / peak:\n  rank";
    for (int c = 0; c < kMemCategoryCount; ++c)
      table += fmt::format(" {:>17}", mem_category_name(static_cast<MemCategory>(c)));
    for (int r = 0; r < world->size(); ++r) {
      table += fmt::format("\n  {:>4}", r);
      for (int c = 0; c < kMemCategoryCount; ++c) {
        const uint64_t* v = all.data() + r * mine.size() + 2 * c;
        table += fmt::format(" {:>8.1f} / {:>6.1f}", v[0] / 1048576.0, v[1] / 1048576.0);
      }
    }
    say(table);
  }
  if (med_mfu > 1.0)
    say(fmt::format("note: MFU above 100% means the device peak ({}) is too low -- it was probably measured on a busy "
                    "machine; run `loom info --remeasure` on an idle one", peak.source));
  if (tracer.on() && !quiet && wall > 0) say(profile::format_breakdown(profile::breakdown(tracer, wall)));
  if (!cfg.trace.file.empty() && world) {
    // One trace for the job: every rank a process, clocks aligned to rank 0's.
    parallel::write_merged_trace(tracer, world->group(), cfg.trace.file);
    say(fmt::format("trace of all {} ranks written to {} (open in https://ui.perfetto.dev)", world->size(),
                    cfg.trace.file));
  } else if (!cfg.trace.file.empty()) {
    tracer.write_chrome_trace(cfg.trace.file);
    say("trace written to " + cfg.trace.file + " (open in https://ui.perfetto.dev)");
  }
  if (o.json && lead) {
    nlohmann::json j{{"framework", "loom"},   {"preset", cfg.model.preset}, {"precision", model::precision_name(cfg.precision)},
                     {"threads", threads},    {"tokens_per_s", med_tps},    {"mfu", med_mfu},
                     {"hfu", hfu},            {"final_loss", last_loss},    {"steps", cfg.train.steps},
                     {"last_step", last_step},
                     {"peak_flops", peak.flops_per_s}, {"peak_bytes", alloc.total().peak}};
    if (last_val) j["val_loss"] = *last_val;
    // A preempted run says so: what stopped it and the step its checkpoint holds.
    j["stopped_by"] = preempted ? nlohmann::json(stopped_by) : nlohmann::json(nullptr);
    if (last_saved > 0) j["saved_step"] = last_saved;
    // Rank 0's peak bytes by category (under ZeRO its shards; a checkpoint save adds the gathered
    // moments, and under ZeRO-3 the gathered weights, for its duration).
    for (int c = 0; c < kMemCategoryCount; ++c) {
      const auto cat = static_cast<MemCategory>(c);
      j["peak_bytes_by_category"][std::string(mem_category_name(cat))] = alloc.stats(cat).peak;
      j["live_bytes_by_category"][std::string(mem_category_name(cat))] = alloc.stats(cat).live;
    }
    if (trainer.zero_stage() >= 1) j["on_demand_resident_bytes"] = trainer.on_demand_resident_bytes();
    fmt::print("{}\n", j.dump());
  }
  // Preempted: the shell convention for death by that signal (143 for SIGTERM), which torchrun-style
  // agents read as "stopped, resumable", never 0 (finished) or 1 (failed).
  return preempted ? 128 + stop_signal : 0;
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
