// What a traced run's steps were made of, per rank and per kernel class, from its spans alone
// (trace_reader.h). Definitions follow Holistic Trace Analysis' temporal and communication-overlap
// breakdowns, with Loom's span categories:
//   compute        union of GEMM and other kernel spans (gemm / other: the union of each)
//   communication  waits of the training thread on collectives (Communication spans): exposed = their
//                  union, sum = their total; pipeline transfer waits (pp_*) are counted apart as the
//                  pipeline's wait (its bubble plus exposed point-to-point transfers)
//   in flight      asynchronous collectives from issue to completion (InFlight spans); overlapped = the
//                  part of that under compute
//   host           the part of a step no compute or wait covers (the host loop: launching, bookkeeping,
//                  data); host_traced is the part of it inside Host spans (data_load, checkpoint_save)
//   idle           time between steps (validation, checkpoints, anything outside a step span)
// Every figure is seconds per step, averaged over the analysed steps (the first `skip_steps` of each
// rank are left out: they pay for primitive creation and page faults).
#pragma once

#include <string>
#include <vector>

#include "loom/profile/trace_reader.h"

namespace loom::profile {

struct RankBreakdown {
  int rank = 0;
  int steps = 0;                         // analysed
  double step = 0;                       // mean step span
  double compute = 0, gemm = 0, other = 0;
  double comm_exposed = 0, comm_sum = 0;
  double pipeline_wait = 0;
  double in_flight = 0, overlapped = 0;
  double host = 0;
  double host_traced = 0;                // of host: spans of traced host work (data loading, checkpoints)
  double idle = 0;                       // between analysed steps, per step
  double flops = 0, bytes = 0;           // declared by this rank's kernels
};

// One kernel (span name) over every rank: per step and per rank on average.
struct KernelClass {
  std::string name;
  Category category = Category::Kernel;
  double calls = 0, seconds = 0, flops = 0, bytes = 0;
};

// A collective some rank made the others wait for. A wait names its collective (group and sequence
// number, comm::mark_wait); every rank whose progress thread ran it took part, a rank with no wait for it
// waited 0. (Traces whose waits name no collective: the k-th wait of `op` on every rank is one.) The
// rank that waited least arrived last, and every other rank waited the difference. `last_rank` is the rank that arrived last most often; `others_waited` the others' mean
// excess wait per step and per rank (seconds).
struct StragglerWait {
  std::string op;
  int last_rank = 0;
  double others_waited = 0;
};

struct TraceAnalysis {
  std::vector<RankBreakdown> ranks;          // by rank
  std::vector<KernelClass> kernels;          // by time, descending
  std::vector<KernelClass> waits;            // Communication spans by name (per step and rank), descending
  std::vector<KernelClass> host_work;        // Host spans by name (per step and rank), descending
  std::vector<StragglerWait> stragglers;     // by others_waited, descending
  int slowest_rank = 0;                      // the most compute per step
  RankBreakdown mean() const;                // the ranks' mean (rank -1)
};

// Throws ConfigError when no rank has a step span to analyse.
TraceAnalysis analyse_trace(const std::vector<TraceSpan>& spans, int skip_steps);

// Pipeline transfer spans (the executor's waits on point-to-point exchanges).
bool is_pipeline_wait(const std::string& name);

}  // namespace loom::profile
