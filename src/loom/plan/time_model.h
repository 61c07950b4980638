// Time of one training step for a layout: GEMMs from the shapes each device runs (after TP / CP / EP
// splitting) at a size-dependent efficiency, bounded below by their bytes (roofline); memory-bound
// kernels from bytes moved; TP/SP, CP, EP and PP communication on the links they use; the pipeline
// bubble; DP gradient reduction and ZeRO gathers with the overlap the software allows; the optimizer.
#pragma once

#include <string>
#include <vector>

#include "loom/plan/layout.h"

namespace loom::plan {

// One GEMM a device runs: C[M,N] = A[M,K] B[K,N], `count` times.
struct GemmShape {
  double M = 0, N = 0, K = 0, count = 1;
};
// Seconds for one such GEMM on `hw`: max(FLOPs / (peak * eff(M,N,K)), bytes / achievable bandwidth),
// eff = gemm_max * prod_d d / (d + gemm_half_dim) -- small dimensions leave tiles and SMs idle -- or,
// for a shape and element size in hw.gemm_table (measured by `loom calibrate --model`), that rate.
double gemm_time(const GemmShape& g, const Hardware& hw, double peak, double bytes_per_element);

struct StepTime {
  double compute = 0;        // GEMM time (recompute included), summed over micro-batches
  double memory_bound = 0;   // norms, activations, softmax, dropout, optimizer
  double comm_exposed = 0;   // communication not hidden behind compute
  double bubble = 0;         // pipeline fill and drain
  double overlap = 0;        // compute slowed by the communication it hides (efficiency.overlap_slowdown)
  double recompute = 0;      // of compute + memory_bound: spent recomputing the forward
  double attention = 0;      // of memory_bound: the attention core (scores, softmax, weighted sum)
  // Exposed communication by kind (sums to comm_exposed).
  double tp = 0, cp = 0, ep = 0, pp = 0, dp = 0, zero = 0;
  double total = 0;
  int priced_stage = 0;      // the pipeline rank whose time this is (the slowest stage; 0 without pp)
  // Loom's engine under pp: each pipeline rank's compute and memory-bound time for one micro-batch
  // (forward + backward, its chunks), which the slowest stage's bubble is made of.
  std::vector<double> stage_micro_batch;
  double model_flops = 0;    // per step, Loom's MFU convention (6N + attention)
  double hardware_flops = 0; // per step, what the GEMMs execute (recompute included)
  // Flash attention: the attention core is FLOPs at a GEMM-like rate (counted with compute by bound());
  // materialised, it is also the score matrix's memory passes (left with the memory-bound kernels).
  bool attention_is_compute = true;
  double attention_in_compute() const { return attention_is_compute ? attention : 0; }
  std::string bound() const;  // "compute" (a flash attention core included), "memory", "communication" or "bubble"
};

StepTime step_time(const Layout& l, const Job& j);

// Tokens per second and MFU of a step.
double tokens_per_s(const StepTime& t, const Job& j);
double mfu(const StepTime& t, const Job& j);

}  // namespace loom::plan
