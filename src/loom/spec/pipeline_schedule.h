// Pipeline schedules as data: for every pipeline rank, the ordered list of (micro-batch, chunk, pass)
// it runs in one step, built by a pure function, so the executor is one loop and tests (and the
// planner) can check a schedule without running it.
//
// The model is cut into pp x v chunks (v virtual stages per rank, interleaved round-robin: rank r holds
// chunks r, r + pp, r + 2 pp, ...). A micro-batch's forward goes through chunks 0 .. pp v - 1; its
// backward back from the last. Passes: Forward; Backward (input and weight gradients together); or,
// split (zero-bubble), BackwardInput then BackwardWeight, where only BackwardInput feeds the previous
// chunk and BackwardWeight may run later to fill an idle slot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::spec {

enum class PipelineSchedule { GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1 };
// "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"; parse throws ConfigError listing the names.
const char* schedule_name(PipelineSchedule s);
PipelineSchedule parse_schedule(const std::string& name);

enum class Pass : uint8_t { Forward, Backward, BackwardInput, BackwardWeight };
const char* pass_name(Pass p);  // "F", "B", "BI", "BW"

struct PipelineAction {
  int micro_batch = 0;
  int chunk = 0;  // this rank's local chunk, 0 .. v - 1
  Pass pass = Pass::Forward;
  bool operator==(const PipelineAction&) const = default;
};

struct PipelinePlan {
  PipelineSchedule kind = PipelineSchedule::OneFOneB;
  int pp = 1, v = 1, micro_batches = 1;
  std::vector<std::vector<PipelineAction>> ranks;  // per pipeline rank, in execution order
  // The global chunk (0 .. pp v - 1) that local chunk `chunk` of `rank` is.
  int global_chunk(int rank, int chunk) const { return chunk * pp + rank; }
};

// Throws ConfigError with a valid alternative when the schedule cannot run: pp < 1, m < 1, v != 1 for
// a non-interleaved schedule, v < 2 for interleaved-1f1b, or m not a multiple of pp for interleaved.
PipelinePlan build_pipeline_schedule(PipelineSchedule kind, int pp, int v, int micro_batches);

// Runs a plan with every pass taking one unit of time (Forward 1, Backward 2, BackwardInput 1,
// BackwardWeight 1) and point-to-point transfers free, each rank executing its list in order and
// waiting when the next action's input is not there yet.
struct ScheduleRun {
  bool ok = false;
  std::string problem;          // the first violation or the deadlock, when !ok
  int64_t makespan = 0;         // time until the last action ends
  std::vector<int> peak_in_flight;  // per rank: most micro-batch chunks forwarded and not yet fully backwarded
  std::vector<double> idle;     // per rank: idle fraction of the makespan (the bubble)
};
ScheduleRun simulate(const PipelinePlan& plan);

// Activation contexts the pipeline executor (train::PipelineExecutor) holds at its peak on `rank`, per
// local chunk: a forward takes one (when its input is received, that is when the previous action's
// transfers are posted, else when it runs) and a backward gives it back once its send is done. On a
// rank whose forwards receive nothing (the first stage) this is the schedule's micro-batches in flight;
// elsewhere a forward's receive may be posted while the previous backward still sends, one more.
// evaluation: the forward-only order of `evaluation_order` instead of the plan's, each forward giving
// its context back once its send is done.
std::vector<int> contexts_held(const PipelinePlan& plan, int rank, bool evaluation = false);

// Forwards only (validation), micro-batch by micro-batch through a rank's chunks: each waits only on
// chunks earlier in the same order on other ranks, so it cannot deadlock.
std::vector<PipelineAction> evaluation_order(int v, int micro_batches);

// The textbook bubble fraction: (p - 1) / (m + p - 1) for GPipe and 1F1B, divided by v for interleaved,
// and for zb-h1 the simulation's (W passes fill part of it).
double theoretical_bubble(const PipelinePlan& plan);

}  // namespace loom::spec
