// precision = "fp8": which tensors are quantised, with which scales, and the scaling state across
// steps. The four linears of every block (q|k|v, attention output, up or gate|up, down) quantise their
// GEMM inputs -- activations and weights to E4M3, output gradients to E5M2 (or E4M3) -- and run in
// bf16 on the quantised values (kernels/fp8_quant.h: an exact emulation of fp8 GEMMs with f32
// accumulation, not a speed-up). The LM head, attention, norms and the loss stay bf16, as in
// Transformer Engine and NeuronX Distributed.
//
// Recipes (fp8.recipe):
//   delayed   -- per tensor, the scale from the largest amax of the last fp8.amax_history steps
//                (Transformer Engine's default "max" algorithm); a tensor with no history yet (the
//                first step) is scaled by its own amax. The amaxes are reduced (max) over every rank
//                at the end of each step, so every rank scales alike whatever the layout, and the
//                histories are saved in checkpoints.
//   current   -- per tensor, the scale from the tensor's own amax at the moment it is quantised
//                (on this rank: under tp a shard's own).
//   blockwise -- DeepSeek-V3's: 1 x 128 blocks of activation and gradient rows, 128 x 128 weight
//                tiles, each scaled by its own amax.
// Every scale is a power of two (kernels::fp8_scale).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/fp8.h"
#include "loom/kernels/fp8_quant.h"
#include "loom/model/block.h"

namespace loom::model {

enum class Fp8Scaling { Delayed, Current, Blockwise };
Fp8Scaling parse_fp8_scaling(const std::string& s);  // "delayed" | "current" | "blockwise"; throws ConfigError
const char* fp8_scaling_name(Fp8Scaling s);

struct Fp8Config {
  Fp8Scaling recipe = Fp8Scaling::Delayed;
  int64_t amax_history = 16;                  // delayed: steps of amax kept per tensor
  Fp8Format grad_format = Fp8Format::E5M2;    // output gradients (E4M3: more precision, less range)
  int64_t margin = 0;                         // delayed and current: scales lowered by 2^margin
  int64_t block = 128;                        // blockwise: block (and tile) side
};

// A block's quantised linears, in BlockWeights' order, and what each quantises.
enum class Fp8Linear { Qkv, Out, Up, Down };
enum class Fp8Role { Input, Weight, OutputGrad };

// One tensor's overflow and underflow counts over a step (summed over the ranks that quantised it).
struct Fp8TensorCounts {
  std::string name;  // "layers.3.up.input"
  int64_t overflow = 0, underflow = 0;
};

class Fp8Recipe {
 public:
  Fp8Recipe(Fp8Config cfg, int64_t n_layers, Allocator& alloc);

  const Fp8Config& config() const { return cfg_; }
  // The bf16 GEMM input `lp` [N, K] written from `x` [N, K] (f32): block `layer`'s linear `k`.
  void quantize_input(int64_t layer, Fp8Linear k, const Tensor& lp, const Tensor& x);
  // The block's weights as its GEMMs read them: the four linears' weights quantised into this recipe's
  // scratch (one block at a time; the same block again in the same step is not quantised again).
  BlockWeights weights(int64_t layer, const BlockWeights& w);
  // A linear's output gradient dy [N, OC] (f32) quantised into `out` (f32, same shape; exactly
  // representable in bf16, so the backward's cast keeps it).
  void quantize_output_grad(int64_t layer, Fp8Linear k, const Tensor& out, const Tensor& dy);

  // At the end of every step (applied or skipped): `reduce(amax, counts)` makes the step's per-tensor
  // amaxes the max and the counts the sum over every rank; the amaxes enter the histories, and the
  // counts become last_step_counts().
  using Reduce = std::function<void(std::span<float> amax, std::span<double> counts)>;
  void end_step(const Reduce& reduce);
  // The weights changed outside an update (a checkpoint was loaded): quantise them again.
  void weights_changed() { ++generation_; }
  // Tensors with any overflow or underflow in the step that ended last, and the totals.
  const std::vector<Fp8TensorCounts>& last_step_counts() const { return last_counts_; }
  int64_t last_step_overflow() const { return last_overflow_; }
  int64_t last_step_underflow() const { return last_underflow_; }

  // Scaling state for checkpoints: per tensor (by name) its amax history, oldest first.
  std::vector<std::pair<std::string, std::vector<float>>> histories() const;
  // Restores what histories() gave (any layout: tensors are named by their global layer); tensors not
  // named start empty, and a history longer than fp8.amax_history keeps its newest entries. Throws
  // ConfigError on a tensor this model does not have or an amax that is negative or not finite.
  void restore(const std::vector<std::pair<std::string, std::vector<float>>>& histories);

  size_t slots() const { return slot_stats_.size(); }
  static std::string slot_name(size_t slot);

 private:
  size_t slot(int64_t layer, Fp8Linear k, Fp8Role r) const;
  Fp8Format format(Fp8Role r) const { return r == Fp8Role::OutputGrad ? cfg_.grad_format : Fp8Format::E4M3; }
  // The per-tensor scale (delayed or current) of a slot, `current_amax` computing the tensor's amax.
  float tensor_scale(size_t s, Fp8Role r, const std::function<float()>& current_amax) const;
  void record(size_t s, const kernels::Fp8Stats& st);

  Fp8Config cfg_;
  int64_t n_layers_;
  Allocator& alloc_;
  std::vector<kernels::Fp8Stats> slot_stats_;  // this step, this rank
  std::vector<std::vector<float>> history_;    // per slot, oldest first, at most amax_history
  Tensor weight_scratch_;                      // bf16: one block's four quantised weights
  int64_t cached_layer_ = -1, cached_generation_ = -1, generation_ = 0;
  BlockWeights cached_;
  std::vector<Fp8TensorCounts> last_counts_;
  int64_t last_overflow_ = 0, last_underflow_ = 0;
};

}  // namespace loom::model
