// AdamW on fp32 master weights with decoupled weight decay applied only to parameters the spec marks
// for it (matrices). Moments live in two arenas laid out like the parameters. In bf16 mode the same
// pass refreshes the bf16 compute copy of each updated weight.
#pragma once

#include <cstdint>

#include "loom/core/tensor.h"
#include "loom/model/parameter_store.h"
#include "loom/profile/tracer.h"

namespace loom::train {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

class AdamW {
 public:
  // Owns the moments of arena elements [shard_begin, shard_end) and updates only those (ZeRO-1: each
  // data-parallel rank one shard); shard_end < 0 means the whole arena.
  AdamW(model::ParameterStore& params, AdamWConfig cfg, Allocator& alloc, int64_t shard_begin = 0,
        int64_t shard_end = -1);
  // One update with learning rate `lr`; gradients are multiplied by `grad_scale` (clipping) first.
  void step(double lr, double grad_scale, profile::Tracer* tracer);
  int64_t steps_taken() const { return step_; }
  // After loading m and v from a checkpoint: the bias corrections continue from `steps`.
  void restore_steps(int64_t steps) { step_ = steps; }
  // Moments of the shard: element i is arena element shard_begin() + i.
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  int64_t shard_begin() const { return lo_; }
  int64_t shard_end() const { return hi_; }
  bool sharded() const { return lo_ != 0 || hi_ != params_.table().total_numel(); }

 private:
  model::ParameterStore& params_;
  AdamWConfig cfg_;
  int64_t lo_, hi_;
  Tensor m_, v_;
  int64_t step_ = 0;
};

// Global L2 norm of all gradients (accumulated in double).
double global_grad_norm(const model::ParameterStore& params);
// Sum of squares of gradient elements [begin, end) (a shard's part of the norm).
double grad_sum_squares(const model::ParameterStore& params, int64_t begin, int64_t end);

}  // namespace loom::train
