#include "loom/train/step_hooks.h"

namespace loom::train {

StepHooks::StepHooks(int64_t n_layers, parallel::GradBuckets* buckets, std::vector<int64_t> block_starts,
                     parallel::ZeroEngine* zero)
    : L_(n_layers), buckets_(buckets), block_starts_(std::move(block_starts)), zero_(zero) {}

void StepHooks::before_forward(int64_t unit) {
  if (!zero3()) return;
  const size_t tail = plan_unit(L_);
  if (unit < 0) {
    // The embeddings and the head (tied or not) are used at both ends of the pass: gather them first,
    // with block 0 right behind.
    zero_->require(plan_unit(-1));
    zero_->prefetch(tail);
    zero_->prefetch(plan_unit(0));
  } else if (unit < L_) {
    zero_->require(plan_unit(unit));
    if (unit + 1 < L_) zero_->prefetch(plan_unit(unit + 1));
  } else {
    zero_->require(tail);
  }
}

void StepHooks::after_forward(int64_t unit) {
  if (!zero3()) return;
  // The last block is needed again at once by backward: keep it instead of gathering it twice.
  if (unit >= 0 && unit < L_ && !(training_ && unit == L_ - 1)) zero_->release(plan_unit(unit));
  if (unit == L_ && !training_) {
    zero_->release(plan_unit(-1));
    zero_->release(plan_unit(L_));
  }
}

void StepHooks::before_backward(int64_t unit) {
  if (zero3()) {
    if (unit == L_) {
      if (L_ > 0) zero_->prefetch(plan_unit(L_ - 1));
    } else if (unit >= 0) {
      zero_->require(plan_unit(unit));
      if (unit > 0) zero_->prefetch(plan_unit(unit - 1));
    }
  }
  if (zero_ && zero_->stage() >= 2) {
    // A tied head adds into the embedding gradient from the first unit of backward on.
    if (unit == L_) {
      zero_->zero_unit_grads(plan_unit(L_));
      zero_->zero_unit_grads(plan_unit(-1));
    } else if (unit >= 0) {
      zero_->zero_unit_grads(plan_unit(unit));
    }
  }
}

void StepHooks::after_backward(int64_t unit) {
  if (buckets_ && reduce_) buckets_->ready_from(unit >= 0 ? block_starts_[static_cast<size_t>(unit)] : 0);
  if (zero_ && reduce_) {
    const size_t u = plan_unit(unit);
    zero_->reduce_unit(u);
    if (zero_->stage() >= 2) {
      // One unit's reduction overlaps the next unit's backward; then its pages go back.
      if (reducing_) zero_->finish_unit(*reducing_);
      reducing_ = u;
      if (unit < 0) {
        zero_->finish_all();
        reducing_.reset();
      }
    }
  }
  if (zero3()) {
    if (unit >= 0 && unit < L_) zero_->release(plan_unit(unit));
    if (unit < 0) {
      zero_->release(plan_unit(-1));
      zero_->release(plan_unit(L_));
    }
  }
}

}  // namespace loom::train
