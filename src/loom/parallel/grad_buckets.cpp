#include "loom/parallel/grad_buckets.h"

namespace loom::parallel {

GradBuckets::GradBuckets(const spec::ParamTable& table, float* grads, comm::ProcessGroup& dp, size_t bucket_bytes)
    : grads_(grads), dp_(dp), total_(table.total_numel()) {
  const auto& params = table.params();
  const int64_t target = bucket_bytes == 0 ? total_ : static_cast<int64_t>(bucket_bytes / sizeof(float));
  int64_t hi = total_;
  for (size_t i = params.size(); i-- > 0;) {
    const int64_t lo = params[i].offset;
    // Close the bucket at this parameter's start once it holds enough, or at the arena's start.
    if (hi - lo >= target || lo == 0) {
      bounds_.emplace_back(lo, hi);
      hi = lo;
    }
  }
}

void GradBuckets::begin() {
  next_ = 0;
  in_flight_.clear();
}

void GradBuckets::ready_from(int64_t first) {
  while (next_ < bounds_.size() && bounds_[next_].first >= first) {
    const auto [lo, hi] = bounds_[next_++];
    in_flight_.push_back(
        dp_.all_reduce(grads_ + lo, grads_ + lo, static_cast<size_t>(hi - lo), DType::F32, comm::ReduceOp::kSum));
  }
}

void GradBuckets::finish() {
  ready_from(0);
  for (auto& w : in_flight_) w.wait();
  in_flight_.clear();
}

}  // namespace loom::parallel
