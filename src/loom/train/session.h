// One training run as a user starts it, from a resolved config: joins the job (`loom run`, mpirun, srun)
// and lays the ranks on the mesh, checks that the ranks agree, builds the trainer, resumes, runs the loop
// (checkpoint cadence, signal agreement across ranks, replica checks) and sums the run up. The CLI parses
// flags and prints what the Session reports; Python bindings will call the same.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "loom/train/run_config.h"
#include "loom/train/trainer.h"

namespace loom::train {

struct SessionOptions {
  bool resume = false;         // continue from checkpoint.dir's latest checkpoint
  std::string resume_from;     // or from this one (a step folder or a checkpoint dir)
  int64_t check_replicas = 0;  // every N steps, compare the data-parallel replicas (0: never)
  int threads = 1;             // compute threads of this rank
  std::string version, commit;  // the build: in the manifest, and compared across ranks
};

// What a Session tells its user as it goes. Only the rank that speaks (rank 0) calls it.
class SessionReporter {
 public:
  virtual ~SessionReporter() = default;
  // A line about the run: start-up facts, a checkpoint written, a note, the summary.
  virtual void note(const std::string& line) = 0;
  // A progress line; `keep` is false for a line the next one may overwrite (a terminal's status line).
  virtual void progress(const std::string& line, bool keep) = 0;
  // Whether progress lines are wanted at all (computing them costs nothing, but a quiet run skips it).
  virtual bool wants_progress() const { return true; }
};

// How the run ended and what it measured: what `loom train --json` prints.
struct SessionSummary {
  bool lead = false;             // this rank speaks and writes (rank 0)
  bool already_complete = false;  // resumed at or past train.steps: nothing ran
  int64_t last_step = 0;          // the last step that ran
  int64_t saved_step = 0;         // the step the newest checkpoint of this run holds (0: none)
  int stop_signal = 0;            // the signal that stopped it, agreed by every rank (0: it finished)
  std::string stopped_by;         // "SIGTERM", ... ("" when it finished)
  double final_loss = 0;
  int64_t skipped_steps = 0;      // steps not applied (non-finite, or a loss spike): train/bad_step_guard.h
  std::optional<double> val_loss;
  double tokens_per_s = 0, mfu = 0, hfu = 0;  // medians after the first steps; HFU over the whole run
  double peak_flops = 0;
  int threads = 0;
  uint64_t peak_bytes = 0;
  std::map<std::string, uint64_t> peak_bytes_by_category, live_bytes_by_category;  // this rank's
  std::vector<std::map<std::string, uint64_t>> peak_bytes_by_rank;  // every rank's peaks (multi-rank jobs)
  std::optional<uint64_t> on_demand_resident_bytes;  // ZeRO: pages actually resident
  // Rank 0's traced time per step after the first steps (trace.summary on): wall, GEMMs, other kernels,
  // communication waited for (exposed), asynchronous collectives in flight and the part of that hidden
  // under compute, and the untraced rest (host). Seconds; empty when tracing was off.
  struct StepSplit {
    double wall = 0, gemm = 0, kernels = 0, comm_exposed = 0, comm_in_flight = 0, comm_hidden = 0, host = 0;
  };
  std::optional<StepSplit> step_split;
  // Pipeline parallelism: each stage's median idle fraction of the schedule over the steps after the
  // first ones (StepMetrics::pipeline_idle), beside the schedule's theoretical bubble.
  struct PipelineBubble {
    std::string schedule;
    std::vector<double> idle;  // per pipeline rank
    double theory = 0;
  };
  std::optional<PipelineBubble> pipeline;

  // 0 finished; 128 + signal when preempted (143 for SIGTERM): torchrun-style agents read it as
  // "stopped, resumable".
  int exit_status() const { return stop_signal != 0 ? 128 + stop_signal : 0; }
};

class Session {
 public:
  Session(RunConfig cfg, SessionOptions options, SessionReporter& out)
      : cfg_(std::move(cfg)), options_(std::move(options)), out_(out) {}
  // Runs the whole session, collective over the job; throws loom::Error subclasses (config, I/O,
  // communication, numerics) naming what went wrong.
  SessionSummary run();

 private:
  RunConfig cfg_;
  SessionOptions options_;
  SessionReporter& out_;
};

}  // namespace loom::train
