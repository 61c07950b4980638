// AdamW on fp32 master weights with decoupled weight decay applied only to parameters the spec marks
// for it (matrices). Moments live in two arenas laid out like the parameters. In bf16 mode the same
// pass refreshes the bf16 compute copy of each updated weight. With bf16-only weights (bf16-pure) the
// moments are bf16 as well and each update is rounded stochastically into all three.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/model/parameter_store.h"
#include "loom/profile/tracer.h"

namespace loom::train {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

class AdamW {
 public:
  // Owns the moments of the arena ranges `pieces` and updates only those (ZeRO: each data-parallel rank
  // its pieces of every unit); empty means the whole arena.
  AdamW(model::ParameterStore& params, AdamWConfig cfg, Allocator& alloc, std::vector<spec::ArenaRange> pieces = {});
  // One update with learning rate `lr`; gradients are multiplied by `grad_scale` (clipping) first.
  void step(double lr, double grad_scale, profile::Tracer* tracer);
  int64_t steps_taken() const { return step_; }
  // Moments in bf16 (precision = "bf16-pure") or f32.
  DType moment_dtype() const { return m_.dtype(); }
  // After loading m and v from a checkpoint: the bias corrections continue from `steps`.
  void restore_steps(int64_t steps) {
    step_ = steps;
    params_.set_rounding_step(steps);  // bf16-sr: the copies a refresh writes are the last update's
  }
  // Moments of the pieces laid end to end: piece k starts at local_offset(k).
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  const std::vector<spec::ArenaRange>& pieces() const { return pieces_; }
  int64_t local_offset(size_t k) const { return local_[k]; }
  bool sharded() const { return sharded_; }

 private:
  void step_bf16(double lr, double grad_scale, profile::Tracer* tracer);  // bf16-only weights and moments

  model::ParameterStore& params_;
  AdamWConfig cfg_;
  std::vector<spec::ArenaRange> pieces_;
  std::vector<int64_t> local_;
  bool sharded_;
  Tensor m_, v_;
  int64_t step_ = 0;
};

// Global L2 norm of all gradients (accumulated in double).
double global_grad_norm(const model::ParameterStore& params);
// Sum of squares of the gradient elements in `pieces` (a shard's part of the norm).
double grad_sum_squares(const model::ParameterStore& params, const std::vector<spec::ArenaRange>& pieces);

}  // namespace loom::train
