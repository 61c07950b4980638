// Learning rate at a step: linear warm-up from 0 to the peak, then cosine decay to min_lr at the last
// step. A pure function of the step, so a resumed run continues on the same curve.
#pragma once

#include <cstdint>

namespace loom::train {

struct LrSchedule {
  double peak = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  // step counts from 1.
  double at(int64_t step) const;
};

}  // namespace loom::train
