// The model's per-unit hooks, handed to data parallelism: whatever the strategy (parallel::DataParallel:
// DDP buckets, ZeRO's gathers and reductions, or nothing alone), it sees each unit of a micro-batch's
// forward and backward while the model itself knows nothing of it.
#pragma once

#include <cstdint>

#include "loom/model/layer_hooks.h"
#include "loom/parallel/data_parallel.h"

namespace loom::train {

class StepHooks final : public model::LayerHooks {
 public:
  explicit StepHooks(parallel::DataParallel& dp) : dp_(dp) {}

  void before_forward(int64_t unit) override { dp_.before_forward(unit); }
  void after_forward(int64_t unit) override { dp_.after_forward(unit); }
  void before_backward(int64_t unit) override { dp_.before_backward(unit); }
  void after_backward(int64_t unit) override { dp_.after_backward(unit); }

 private:
  parallel::DataParallel& dp_;
};

}  // namespace loom::train
