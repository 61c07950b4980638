// What data parallelism does around each unit of a micro-batch's forward and backward: DDP buckets
// all-reduced as soon as their gradients are final; ZeRO-1/2/3 gradients reduce-scattered unit by unit
// into their owners' pieces; ZeRO-3 weights gathered just before use (the next unit's gather issued
// ahead, so it overlaps this unit's compute) and given back after. The Trainer sets the mode per
// micro-batch; the model only calls the hooks.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "loom/model/layer_hooks.h"
#include "loom/parallel/grad_buckets.h"
#include "loom/parallel/zero_engine.h"

namespace loom::train {

class StepHooks final : public model::LayerHooks {
 public:
  // buckets: DDP (nullptr under ZeRO); zero: ZeRO (nullptr without). block_starts as
  // spec::ParamTable::block_starts (the DDP readiness boundaries).
  StepHooks(int64_t n_layers, parallel::GradBuckets* buckets, std::vector<int64_t> block_starts,
            parallel::ZeroEngine* zero);

  // Before each forward. training: a backward follows (ZeRO-3 keeps the last block and the outer units
  // gathered for it). reduce: this micro-batch's gradients are reduced across the dp group.
  void set_mode(bool training, bool reduce) {
    training_ = training;
    reduce_ = reduce;
  }

  void before_forward(int64_t unit) override;
  void after_forward(int64_t unit) override;
  void before_backward(int64_t unit) override;
  void after_backward(int64_t unit) override;

 private:
  // ShardPlan unit of a model unit: embeddings 0, block l l+1, final norm + head n_layers+1.
  size_t plan_unit(int64_t unit) const { return static_cast<size_t>(unit + 1); }
  bool zero3() const { return zero_ && zero_->stage() == 3; }

  int64_t L_;
  parallel::GradBuckets* buckets_;
  std::vector<int64_t> block_starts_;
  parallel::ZeroEngine* zero_;
  bool training_ = true, reduce_ = false;
  std::optional<size_t> reducing_;  // ZeRO-2/3: the unit whose reduction overlaps the current backward
};

}  // namespace loom::train
