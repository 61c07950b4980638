#include "loom/train/session.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "loom/comm/world.h"
#include "loom/core/output_folder.h"
#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/peak_probe.h"
#include "loom/parallel/mesh.h"
#include "loom/parallel/parallelize.h"
#include "loom/parallel/trace_merge.h"
#include "loom/train/async_checkpoint.h"
#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_manifest.h"
#include "loom/train/preemption.h"
#include "loom/train/rank_agreement.h"
#include "loom/train/run_log.h"

namespace loom::train {

namespace fs = std::filesystem;

namespace {

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

// Every rank's memory by category, at rest (live after the last step) and at peak, as a table.
// Collective: every rank's live and peak bytes per category, on every rank; the table rank 0 prints,
// and each rank's peaks by category name into `peaks`.
std::string memory_table(const Allocator& alloc, comm::ProcessGroup& world,
                         std::vector<std::map<std::string, uint64_t>>& peaks) {
  std::vector<uint64_t> mine;
  for (int c = 0; c < kMemCategoryCount; ++c) {
    mine.push_back(alloc.stats(static_cast<MemCategory>(c)).live);
    mine.push_back(alloc.stats(static_cast<MemCategory>(c)).peak);
  }
  std::vector<uint64_t> all(mine.size() * static_cast<size_t>(world.size()));
  world.all_gather(mine.data(), all.data(), mine.size(), DType::I64).wait();
  peaks.assign(static_cast<size_t>(world.size()), {});
  for (int r = 0; r < world.size(); ++r)
    for (int c = 0; c < kMemCategoryCount; ++c)
      peaks[static_cast<size_t>(r)][std::string(mem_category_name(static_cast<MemCategory>(c)))] = all[r * mine.size() + 2 * c + 1];
  std::string table = "memory per rank, MiB at rest / peak:\n  rank";
  for (int c = 0; c < kMemCategoryCount; ++c) table += fmt::format(" {:>17}", mem_category_name(static_cast<MemCategory>(c)));
  for (int r = 0; r < world.size(); ++r) {
    table += fmt::format("\n  {:>4}", r);
    for (int c = 0; c < kMemCategoryCount; ++c) {
      const uint64_t* v = all.data() + r * mine.size() + 2 * c;
      table += fmt::format(" {:>8.1f} / {:>6.1f}", v[0] / 1048576.0, v[1] / 1048576.0);
    }
  }
  return table;
}

// Steps whose spans the tracer holds at the end: those after the warm-up reset (all when the run resumed
// past it).
int64_t sum_steps_after(int64_t warmup, int64_t last_step, int64_t start_step) {
  return last_step - std::max(warmup, start_step);
}

}  // namespace

SessionSummary Session::run() {
  const RunConfig& cfg = cfg_;
  const SessionOptions& o = options_;
  // A multi-rank job (loom run, mpirun, srun): join it and lay the ranks out on the mesh. Rank 0 speaks,
  // logs and saves; the replicas it stands for hold the same state.
  const comm::JobEnv job = comm::read_job_env();
  const parallel::MeshShape shape{static_cast<int>(cfg.parallel.pp), static_cast<int>(cfg.parallel.dp),
                                  static_cast<int>(cfg.parallel.cp), static_cast<int>(cfg.parallel.tp)};
  parallel::validate_mesh(shape, job.world_size);  // before any work: the layout must fit the job
  Allocator alloc;
  std::unique_ptr<comm::World> world;
  std::unique_ptr<parallel::Mesh> mesh;
  if (job.world_size > 1) {
    world = comm::World::join(job, comm::comm_options_from_env(comm::current_environment()), &alloc);
    mesh = std::make_unique<parallel::Mesh>(shape, *world);
  }
  SessionSummary sum;
  sum.lead = job.rank == 0;
  sum.threads = o.threads;
  auto say = [&](const std::string& line) {
    if (sum.lead) out_.note(line);
  };

  // Rank 0 writes the trace (the merged one of a multi-rank job): its path is checked before any work.
  if (!cfg.trace.file.empty() && job.rank == 0) profile::Tracer::prepare_trace_file(cfg.trace.file);
  // The checkpoint folder too (CheckpointManager checks it again), before the metrics log is opened.
  check_output_folder(cfg.checkpoint.dir, "checkpoint.dir (--save-dir)");
  profile::Tracer tracer(!cfg.trace.file.empty() ? profile::Tracer::Mode::Full
                         : cfg.trace.summary    ? profile::Tracer::Mode::Summary
                                                : profile::Tracer::Mode::Off,
                         job.rank);
  // The groups' progress threads record each op they run (CommWork spans) while this tracer lives.
  struct GroupTracing {
    std::vector<comm::ProcessGroup*> groups;
    ~GroupTracing() {
      for (auto* g : groups) g->set_tracer(nullptr);
    }
  } group_tracing;
  if (world && tracer.on()) {
    group_tracing.groups.push_back(&world->group());
    for (auto axis : {spec::MeshAxis::PP, spec::MeshAxis::DP, spec::MeshAxis::CP, spec::MeshAxis::TP})
      if (comm::ProcessGroup* g = mesh->group(axis)) group_tracing.groups.push_back(g);
    for (auto* g : group_tracing.groups) g->set_tracer(&tracer);
  }
  if (const char* cap = std::getenv("LOOM_MEMORY_LIMIT"); cap && *cap) {
    // Bytes, or with a K / M / G suffix (powers of 1024).
    char* end = nullptr;
    const double v = std::strtod(cap, &end);
    const std::string unit(end);
    const double scale = unit.empty() ? 1 : unit == "K" ? 1024.0 : unit == "M" ? 1048576.0 : unit == "G" ? 1073741824.0 : -1;
    if (end == cap || scale < 0 || v <= 0)
      throw ConfigError(std::string("LOOM_MEMORY_LIMIT = '") + cap + "' is not a size (bytes, or a number with K, M or G)");
    alloc.set_limit(static_cast<size_t>(v * scale));
    say(fmt::format("memory limit: {:.1f} MiB per rank (LOOM_MEMORY_LIMIT)", v * scale / 1048576.0));
  }
  kernels::CpuBackend backend(alloc, &tracer, o.threads);
  RunIdentity id{o.version, o.commit, backend.describe(), o.threads, 0, ""};
  say(fmt::format("loom {} ({}) | {}", id.version, id.commit, id.backend));
  const auto& m = cfg.model.resolved;
  const auto table = spec::build_param_table(m);
  // Before any work: every rank runs the same build, config, model and layout (else one line naming what
  // differs, instead of replicas that silently diverge).
  if (world)
    check_ranks_agree(world->group(), run_facts(cfg, table, world->size(), fmt::format("{} ({})", id.version, id.commit)),
                      "the run");
  say(fmt::format("model {} ({}): {:.2f} M parameters, L={} C={} H={} KV={} V={} | {}{} | batch {} x {} tokens (micro {})",
                  cfg.model.preset, spec::arch_name(m.arch), table.total_numel() * 1e-6, m.n_layers, m.d_model,
                  m.n_heads, m.n_kv_heads, m.vocab_size, cfg.precision_label(),
                  cfg.train.recompute == spec::Recompute::None
                      ? std::string()
                      : " | recompute " + std::string(spec::recompute_name(cfg.train.recompute)),
                  cfg.train.batch_size, cfg.seq_len(), cfg.micro_batch()));
  if (cfg.fp8)
    say(fmt::format("fp8 ({} scaling, E4M3 activations and weights, {} gradients) is emulated: the blocks' "
                    "linears quantise their inputs to fp8 values and run them through bf16 GEMMs -- fp8's numerics, "
                    "not its speed",
                    cfg.fp8_options.recipe, cfg.fp8_options.grad_format == "e4m3" ? "E4M3" : "E5M2"));
  const DType peak_type = cfg.precision == model::Precision::BF16 ? DType::BF16 : DType::F32;
  auto peak = kernels::device_peak_flops(peak_type, o.threads);
  id.peak_flops = peak.flops_per_s;
  id.peak_source = peak.source;
  sum.peak_flops = peak.flops_per_s;
  say(fmt::format("device peak {} GEMM {:.1f} GFLOP/s ({})", dtype_name(peak_type), peak.flops_per_s * 1e-9, peak.source));
  if (world)
    say(fmt::format("job: {} ranks ({}) on {} node(s), {} transport, mesh {}{}", world->size(),
                    comm::launcher_name(job.launcher), world->nodes(), world->group().transport_name(), shape.str(),
                    shape.tp > 1 ? fmt::format(" | tensor parallel: sequence parallel {}, overlap {}",
                                               cfg.parallel.sequence_parallel ? "on" : "off",
                                               cfg.parallel.tp_overlap ? "on" : "off")
                                 : std::string()));

  // A job that `loom run --max-restarts` started again continues from the newest complete checkpoint
  // of checkpoint.dir (the failed attempt's, or the one it resumed from), or starts from step 0 again
  // when there is none. Every rank decides alike: the ranks of the failed attempt are all gone.
  std::string resume_from = o.resume_from;
  if (job.restart_count > 0) {
    // The checkpoint the first attempt resumed from may have been pruned since (checkpoint.keep): then
    // the newest is the one to continue from.
    auto step_of = [](const std::string& dir) -> std::optional<int64_t> {
      try {
        return read_checkpoint_manifest(resolve_checkpoint(dir)).step;
      } catch (const Error&) {
        return std::nullopt;
      }
    };
    if (auto newest = newest_complete_checkpoint(cfg.checkpoint.dir); newest) {
      const auto given = resume_from.empty() ? std::nullopt : step_of(resume_from);
      if (!given || read_checkpoint_manifest(*newest).step >= *given) resume_from = *newest;
    }
    say(fmt::format("restart {} of the job: {}", job.restart_count,
                    resume_from.empty() && !o.resume ? "no checkpoint was saved, starting again from step 0"
                                                     : "continuing from " + (resume_from.empty() ? cfg.checkpoint.dir
                                                                                                   : resume_from)));
  }
  const bool resuming = o.resume || !resume_from.empty();
  std::optional<MetricsLog> log;
  if (sum.lead) {
    write_run_manifest(cfg.train.out_dir, cfg, id);
    log.emplace(cfg.train.out_dir, /*append=*/resuming);
  }
  std::optional<spec::PipelineStages> stages;
  if (cfg.parallel.pp > 1) {
    stages = spec::cut_pipeline(m, cfg.seq_len(), static_cast<int>(cfg.parallel.pp),
                                static_cast<int>(cfg.parallel.pipeline_virtual_stages),
                                spec::parse_layer_counts(cfg.parallel.pipeline_layers, "parallel.pipeline.layers"));
    say(fmt::format("pipeline: {} schedule, {} chunks of blocks {}", cfg.parallel.pipeline_schedule, stages->chunks(),
                    stages->str()));
  }
  if (cfg.parallel.cp > 1)
    say(fmt::format("context parallelism: {} over {} ranks, {} of each sample's {} tokens per rank (head and tail "
                    "chunks)",
                    cfg.parallel.cp_mode, cfg.parallel.cp, cfg.seq_len() / cfg.parallel.cp, cfg.seq_len()));
  const parallel::Parallelism par = parallel::parallelize(
      mesh.get(), backend, {cfg.parallel.sequence_parallel, cfg.parallel.tp_overlap}, stages ? &*stages : nullptr,
      spec::parse_cp_mode(cfg.parallel.cp_mode), static_cast<int>(cfg.parallel.ep));
  if (cfg.parallel.ep > 1)
    say(fmt::format("expert parallelism: {} experts per MoE block over {} ranks, {} each; their gradients reduced over "
                    "{} rank(s) holding the same ones",
                    cfg.model.resolved.moe.experts, cfg.parallel.ep, cfg.model.resolved.moe.experts / cfg.parallel.ep,
                    cfg.parallel.dp / cfg.parallel.ep));
  Trainer trainer(cfg, backend, peak.flops_per_s, &par);
  say("data: " + trainer.data().describe());
  if (cfg.train.eval_every > 0 && trainer.eval_batches() < cfg.train.eval_batches)
    say(fmt::format("note: train.eval_batches = {} is more than one pass over the validation split ({} samples, "
                    "batch {}): each validation reads {} batches",
                    cfg.train.eval_batches, trainer.data().samples(Split::Validation), cfg.train.batch_size,
                    trainer.eval_batches()));
  if (world) check_ranks_agree(world->group(), data_facts(trainer.data()), "the data");
  if (o.check_replicas > 0 && cfg.parallel.ep > 1)
    say("note: --check-replicas does not yet compare replicas under expert parallelism (each holds other experts); "
        "skipped");
  else if (o.check_replicas > 0 && trainer.zero_stage() == 3)
    say("note: --check-replicas has nothing to compare under parallel.zero = 3 (no state is replicated); skipped");
  CheckpointManager checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep, resuming, world ? world->rank() : 0,
                                world ? world->size() : 1);
  if (world) {
    // A sharded save's ranks write into one folder named by the run: rank 0's id is everyone's.
    std::array<int32_t, 32> id_buf{};
    std::memcpy(id_buf.data(), checkpoints.run_id().data(), std::min(checkpoints.run_id().size(), sizeof(id_buf) - 1));
    world->group().broadcast(id_buf.data(), id_buf.size(), DType::I32, 0).wait();
    checkpoints.set_run_id(std::string(reinterpret_cast<const char*>(id_buf.data())));
  }
  if (resuming) {
    std::string from = !resume_from.empty() ? resume_from : checkpoints.latest().value_or("");
    if (from.empty())
      throw IoError("--resume: no checkpoint in '" + cfg.checkpoint.dir + "' (its `latest` file is missing); " +
                    "train without --resume, or point --resume-from at a checkpoint");
    auto report = load_checkpoint(from, trainer);
    say(fmt::format("resumed from {} at step {}", resolve_checkpoint(from), report.step));
    if (log) log->drop_after(report.step);
    if (!report.changed_keys.empty()) {
      std::string keys;
      for (auto& k : report.changed_keys) keys += (keys.empty() ? "" : ", ") + k;
      say("note: these keys differ from the checkpoint's, so the run will not reproduce the original: " + keys);
    }
  }
  sum.last_step = sum.saved_step = trainer.start_step();
  if (trainer.start_step() >= cfg.train.steps) {
    say(fmt::format("the run is already complete at step {} (train.steps = {}); raise train.steps to train further",
                    trainer.start_step(), cfg.train.steps));
    sum.already_complete = true;
    return sum;
  }
  install_preemption_handlers();

  std::vector<double> tps, mfus, exposed, comm_cpu, step_s;
  std::vector<std::vector<double>> pp_idle;  // per pipeline rank, per step after the warm-up
  double pp_theory = 0;
  // The first steps pay for primitive creation and page faults; exclude them from the summary.
  const int64_t warmup = std::min<int64_t>(2, cfg.train.steps - 1);
  const bool progress = sum.lead && out_.wants_progress();
  // A failure mid-run (a collective that timed out, a peer that died, a bad step) leaves every group's
  // last ops in the run directory for `loom profile hang`.
  auto dump_flight = [&] {
    if (!world) return;
    nlohmann::json groups = nlohmann::json::array();
    groups.push_back(world->group().flight_json());
    for (auto axis : {spec::MeshAxis::PP, spec::MeshAxis::DP, spec::MeshAxis::CP, spec::MeshAxis::TP})
      if (comm::ProcessGroup* g = mesh->group(axis)) groups.push_back(g->flight_json());
    std::error_code ec;
    const fs::path dir = fs::path(cfg.train.out_dir) / "flight";
    fs::create_directories(dir, ec);
    std::ofstream out(dir / fmt::format("rank-{}.json", world->rank()));
    out << nlohmann::json{{"rank", world->rank()}, {"groups", groups}}.dump(1) << "\n";
  };
  AsyncCheckpointWriter writer(checkpoints);
  const bool sharded = cfg.checkpoint.format == "sharded";
  bool writer_busy = false;  // rank 0's background write was in flight at this step boundary
  auto report_saved = [&](std::optional<AsyncCheckpointWriter::Saved> saved) {
    if (!saved) return;
    say("checkpoint saved: " + saved->path + " (written behind training)");
    sum.saved_step = std::max(sum.saved_step, saved->step);
  };
  try {
    trainer.run([&](const StepMetrics& s) {
      if (log) log->write(s);
      // The summary describes the last step that ran, also when a signal ends the run after it.
      sum.last_step = s.step;
      sum.final_loss = s.loss;
      sum.skipped_steps = s.skipped_steps;
      if (s.skipped)  // always said, whatever train.log_every
        say(fmt::format("step {}: not applied: {} ({} skipped so far)", s.step, s.skip_reason, s.skipped_steps));
      if (s.val_loss) sum.val_loss = s.val_loss;
      if (o.check_replicas > 0 && s.step % o.check_replicas == 0) trainer.check_replicas(s.step);
      // Checkpoint at the step boundary: periodically, on preemption, and after the last step.
      const bool periodic = cfg.checkpoint.save_every > 0 && s.step % cfg.checkpoint.save_every == 0;
      const bool final = cfg.checkpoint.save_every > 0 && s.step == s.total_steps;
      sum.stop_signal = preemption_signal();
      if (world) {
        // Ranks may see a signal at different steps: all stop after the same one, or the early ones would
        // leave the others waiting in the next step's collectives. The signal travels too, so every rank
        // reports (and exits with) the one that came.
        // Rank 0 also tells whether a background checkpoint write is still in flight: a save now would
        // wait for it, and the others must then wait for it in the save's barrier (whose deadline is a
        // save's), not in the next step's collectives (whose deadline is a hang's).
        int32_t flags[2] = {sum.stop_signal, writer.in_flight() ? 1 : 0};
        world->group().all_reduce(flags, flags, 2, DType::I32, comm::ReduceOp::kMax).wait();
        sum.stop_signal = flags[0];
        writer_busy = flags[1] != 0;
      }
      const bool preempted = sum.stop_signal != 0;
      report_saved(writer.finished());
      if (periodic || final || preempted) {
        // Sharded: every rank writes its own pieces, nothing is gathered. Whole: rank 0's weights are
        // everyone's; ZeRO moments (and ZeRO-3 weights) and tp / pp shards are first gathered on it.
        if (!sharded) trainer.gather_full_state();
        // Asynchronous: a periodic save is a copy here and a write behind the next steps; the last one
        // and a preempted run's are written before the run ends (waiting for one in flight first).
        const bool behind = cfg.checkpoint.async && periodic && !final && !preempted;
        auto capture = [&](Tensor* into, Allocator* alloc) {
          return sharded ? checkpoints.capture_shard(trainer, s.step, into, alloc)
                         : checkpoints.capture(trainer, s.step, into, alloc);
        };
        if (sharded || sum.lead) {
          profile::Span span(&tracer, behind ? "checkpoint_snapshot" : "checkpoint_save", profile::Category::Host);
          if (behind) {
            report_saved(writer.wait());  // the copy buffer is free again
            writer.submit(capture(&writer.buffer(), &backend.allocator()));
          } else {
            // The last save and a preempted run's are made even when an earlier background write failed
            // (that failure is said, and the run's work is still saved).
            try {
              report_saved(writer.wait());
            } catch (const Error& e) {
              say(std::string("warning: ") + e.what() + "; saving step " + std::to_string(s.step) + " now");
            }
            // (The allocator: bf16-pure's values are widened to f32 into a buffer of it.)
            const std::string path = checkpoints.write(capture(nullptr, &backend.allocator()));
            say("checkpoint saved: " + path);
          }
        }
        if (!sharded) trainer.release_full_state();
        // The others wait here, not in the next collective, for rank 0's write: a large checkpoint may
        // take longer than LOOM_COMM_TIMEOUT, which is sized for a hang, not for a save. Behind
        // training nobody waits, unless rank 0 first waited for the previous write.
        if (world && (!behind || writer_busy)) world->group().barrier(comm::kSaveTimeout).wait();
        if (!behind) sum.saved_step = s.step;
      }
      if (preempted) return false;
      if (s.step > warmup) {
        tps.push_back(s.tokens_per_s), mfus.push_back(s.mfu);
        exposed.push_back(s.exposed_comm_seconds), comm_cpu.push_back(s.comm_cpu_seconds), step_s.push_back(s.step_seconds);
        pp_idle.resize(s.pipeline_idle.size());
        for (size_t r = 0; r < s.pipeline_idle.size(); ++r) pp_idle[r].push_back(s.pipeline_idle[r]);
        pp_theory = s.pipeline_bubble_theory;
      }
      if (s.step == warmup) tracer.reset_stats();
      if (!progress || (s.step % cfg.train.log_every != 0 && s.step != s.total_steps && !s.val_loss)) return true;
      double eta = (s.total_steps - s.step) * (s.elapsed_seconds / static_cast<double>(s.step - trainer.start_step()));
      out_.progress(fmt::format("step {:>{}}/{} | loss {:.4f}{} | lr {:.2e} | gnorm {:.3f} | {:.0f} tok/s | MFU {:.1f}% | ETA {}",
                                s.step, std::to_string(s.total_steps).size(), s.total_steps, s.loss,
                                s.val_loss ? fmt::format(" | val {:.4f}", *s.val_loss) : "", s.lr, s.grad_norm,
                                s.tokens_per_s, 100.0 * s.mfu, duration(eta)),
                    s.val_loss.has_value() || s.step == s.total_steps);
      return true;
    });
  } catch (const std::exception&) {
    try {
      dump_flight();
    } catch (const std::exception&) {
      // The run's own error matters more than a record that could not be written.
    }
    throw;
  }
  if (sum.lead) report_saved(writer.wait());
  const bool preempted = sum.stop_signal != 0;
  if (preempted) {
    const char* abbrev = sigabbrev_np(sum.stop_signal);
    sum.stopped_by = abbrev ? "SIG" + std::string(abbrev) : fmt::format("signal {}", sum.stop_signal);
    say(fmt::format("stopped by {} after step {} of {}, saved as step {}; resume with --resume (checkpoint.dir = {})",
                    sum.stopped_by, sum.last_step, cfg.train.steps, sum.saved_step, cfg.checkpoint.dir));
  }

  double wall = 0, declared = 0;
  for (auto& [name, st] : tracer.stats()) {
    if (name == "step" || name == "eval") wall += st.seconds;
    if (st.category == profile::Category::Gemm || st.category == profile::Category::Kernel) declared += st.flops;
  }
  if (tracer.on() && wall > 0) {
    const auto b = profile::breakdown(tracer, wall);
    // The stats were reset after the warm-up steps: what is left covers the steps after them.
    const double n = static_cast<double>(std::max<int64_t>(1, sum_steps_after(warmup, sum.last_step, trainer.start_step())));
    sum.step_split = SessionSummary::StepSplit{wall / n, b.gemm_seconds / n, b.kernel_seconds / n, b.comm_seconds / n,
                                               b.in_flight_seconds / n,
                                               std::max(0.0, b.in_flight_seconds - b.async_wait_seconds) / n,
                                               b.host_seconds / n};
  }
  sum.tokens_per_s = median(tps);
  sum.mfu = median(mfus);
  sum.hfu = wall > 0 && peak.flops_per_s > 0 ? declared / wall / peak.flops_per_s : 0;
  sum.peak_bytes = alloc.total().peak;
  for (int c = 0; c < kMemCategoryCount; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    sum.peak_bytes_by_category[std::string(mem_category_name(cat))] = alloc.stats(cat).peak;
    sum.live_bytes_by_category[std::string(mem_category_name(cat))] = alloc.stats(cat).live;
  }
  if (trainer.zero_stage() >= 1) sum.on_demand_resident_bytes = trainer.on_demand_resident_bytes();
  say(fmt::format("{}: step {} | loss {:.4f}{}{} | median {:.0f} tok/s | MFU {:.1f}% | HFU {:.1f}% | peak memory {:.1f} MiB | log {}",
                  preempted ? "stopped" : "done", sum.last_step, sum.final_loss,
                  sum.val_loss ? fmt::format(" | val {:.4f}", *sum.val_loss) : "",
                  sum.skipped_steps > 0 ? fmt::format(" | {} step(s) not applied", sum.skipped_steps) : "",
                  sum.tokens_per_s, 100 * sum.mfu,
                  100 * sum.hfu, sum.peak_bytes / 1048576.0, log ? log->path() : std::string("(rank 0 writes it)")));
  if (world && !step_s.empty())
    say(fmt::format("communication per step (median, data- and tensor-parallel): exposed {:.1f} ms ({:.1f}% of the "
                    "step), communication CPU {:.1f} ms",
                    1e3 * median(exposed), 100 * median(exposed) / median(step_s), 1e3 * median(comm_cpu)));
  if (!pp_idle.empty()) {
    SessionSummary::PipelineBubble b{cfg.parallel.pipeline_schedule, {}, pp_theory};
    std::string stages;
    for (size_t r = 0; r < pp_idle.size(); ++r) {
      b.idle.push_back(median(pp_idle[r]));
      stages += fmt::format("{}stage {} {:.1f}%", r ? ", " : "", r, 100 * b.idle.back());
    }
    say(fmt::format("pipeline idle per step (median, waits on transfers over the schedule's time): {} | {} theory "
                    "{:.1f}%",
                    stages, b.schedule, 100 * b.theory));
    sum.pipeline = std::move(b);
  }
  if (world) {
    const std::string t = memory_table(alloc, world->group(), sum.peak_bytes_by_rank);  // collective: every rank takes part
    say(t);
  }
  if (sum.mfu > 1.0)
    say(fmt::format("note: MFU above 100% means the device peak ({}) is too low -- it was probably measured on a busy "
                    "machine; run `loom info --remeasure` on an idle one", peak.source));
  if (tracer.on() && wall > 0) say(profile::format_breakdown(profile::breakdown(tracer, wall)));
  if (!cfg.trace.file.empty() && world) {
    // One trace for the job: every rank a process, clocks aligned to rank 0's.
    parallel::write_merged_trace(tracer, world->group(), cfg.trace.file);
    say(fmt::format("trace of all {} ranks written to {} (open in https://ui.perfetto.dev)", world->size(),
                    cfg.trace.file));
  } else if (!cfg.trace.file.empty()) {
    tracer.write_chrome_trace(cfg.trace.file);
    say("trace written to " + cfg.trace.file + " (open in https://ui.perfetto.dev)");
  }
  return sum;
}

}  // namespace loom::train
