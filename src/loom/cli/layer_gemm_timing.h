// A model's layer GEMMs timed as a training step runs them, for `loom calibrate --model` (the whole
// machine) and `loom bench gemm` (one copy per rank under `loom run`: each rank's share of it while the
// others run theirs).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/dtype.h"
#include "loom/kernels/attention.h"
#include "loom/kernels/gemm.h"
#include "loom/plan/hardware.h"

namespace loom::cli {

// Times one call with the core caches evicted first (16 MiB written, untimed): a training step calls
// each kernel after others have filled the caches with their own data.
class ColdCaches {
 public:
  template <class Kernel>
  double time(Kernel&& kernel) {
    for (size_t i = 0; i < evict_.size(); i += 16) evict_[i] += 1.0f;
    const auto t0 = std::chrono::steady_clock::now();
    kernel();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  std::vector<float> evict_ = std::vector<float>(size_t{4} << 20);
};

// One GEMM's operands (its bias and residual too where the description has them), filled with small
// non-zero values near 1 (as the peak probe: zeros or denormals could take unrepresentative paths), and
// the call that runs it.
struct GemmOperands {
  kernels::GemmDesc d;
  Buffer a, b, c, bias, residual;
  GemmOperands(const kernels::GemmDesc& desc, Allocator& alloc);
  void run(Allocator& alloc);
  double flops() const { return 2.0 * double(d.M) * double(d.N) * double(d.K); }
};

// A linear layer's GEMMs as a training step runs them (kernels::linear_gemms: M rows, N output and K
// input features): the forward with its epilogue (bias, residual add), dX and dW, each called with the
// core caches evicted.
struct LayerGemm {
  int64_t M = 0, N = 0, K = 0;
  DType dtype = DType::BF16;
  bool bias = false;      // the forward adds a bias (GPT-2's linears)
  bool residual = false;  // the forward adds the residual stream in its epilogue (a one-rank block's out and down)
  std::unique_ptr<GemmOperands> fwd, dx, dw;  // kept between rounds while they fit (time_layer_gemms)
  std::vector<double> times;                  // seconds of one fwd + dX + dW, one per round

  size_t bytes() const;
  // One fwd + dX + dW, timed cold; operands built now (untimed) unless kept from the last round.
  double run_once(ColdCaches& cold, bool keep, Allocator& alloc);
};

// Loom's attention kernel (forward, then backward) at one shape, on small random-looking inputs: one
// cold call of each per run_once. Warm, back-to-back calls ran 1.25x faster than the same kernel inside
// `mini`'s step, cold ones within a few percent of it.
class AttentionOperands {
 public:
  explicit AttentionOperands(const kernels::AttentionShape& s);
  double run_once(ColdCaches& cold, Allocator& alloc);  // seconds of one forward + backward
  double flops() const { return flops(s_); }  // the kernels' declared FLOPs of the two
  static double flops(const kernels::AttentionShape& s);
  static size_t bytes(const kernels::AttentionShape& s);  // what the operands of one shape hold

 private:
  kernels::AttentionShape s_;
  std::vector<float> qkv_, out_, lse_, dout_, dqkv_;
};

// A model's attention as a layout's rank runs it: B sequences of T tokens, H query and KVH key/value
// heads of D on the rank (tp splits both; one replicated KV head where tp exceeds them), in the kernels
// the run's precision takes.
struct LayerAttention {
  kernels::AttentionShape shape;
  std::vector<double> times;  // seconds of one forward + backward, one per round
};

// The layer GEMMs of the model in `config` (a `loom train` config) at the shapes its layouts run on
// this machine: rows = the tokens of one micro-batch (the batch, a half and a quarter of it as dp = 2
// and 4 or pipeline micro-batches give, and the configured micro-batch), columns split by tp in {1, 2}
// where tp divides the heads, KV heads and FFN width; the LM head too. A mixture of experts adds its
// experts' GEMMs (at the rows each expert sees) and its shared experts'.
std::vector<LayerGemm> model_layer_gemms(const std::string& config);

// The attention shapes of the model in `config` at the rows model_layer_gemms takes (B = those rows / T)
// and tp in {1, 2} where tp divides the heads.
std::vector<LayerAttention> model_layer_attention(const std::string& config);
// Their rates, timed as time_layer_gemms times the GEMMs (round-robin, cold, median of the rounds, the
// rounds of earlier calls on the same shapes pooled in).
std::vector<plan::MeasuredAttention> time_layer_attention(std::vector<LayerAttention>& shapes, double budget,
                                                          Allocator& alloc);

// Times every shape by the median over rounds, each round visiting every shape once (the first round
// creates the primitives and is not counted), until `budget` seconds per shape have passed (at least 5
// counted rounds). The rates are those of this process's threads. The rounds accumulate in each shape's
// `times`: a second call on the same shapes pools its rounds with the first's (loom calibrate times
// two windows apart).
std::vector<plan::MeasuredGemm> time_layer_gemms(std::vector<LayerGemm>& shapes, double budget, Allocator& alloc);

}  // namespace loom::cli
