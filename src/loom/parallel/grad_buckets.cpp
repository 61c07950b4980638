#include "loom/parallel/grad_buckets.h"

namespace loom::parallel {

GradBuckets::GradBuckets(const spec::ParamTable& table, float* grads, comm::ProcessGroup& dp, size_t bucket_bytes,
                         bool experts_split, comm::ProcessGroup* expert_replicas)
    : grads_(grads), dp_(dp), total_(table.total_numel()), expert_replicas_(expert_replicas) {
  const auto& params = table.params();
  const int64_t target = bucket_bytes == 0 ? total_ : static_cast<int64_t>(bucket_bytes / sizeof(float));
  int64_t hi = total_;
  auto kind = [&](size_t i) { return experts_split && params[i].expert; };
  for (size_t i = params.size(); i-- > 0;) {
    const int64_t lo = params[i].offset;
    // Close the bucket at this parameter's start once it holds enough, at the arena's start, or where
    // the next parameter down reduces over another group.
    if (hi - lo >= target || lo == 0 || (i > 0 && kind(i - 1) != kind(i))) {
      bounds_.push_back({lo, hi, kind(i)});
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
    const auto [lo, hi, expert] = bounds_[next_++];
    comm::ProcessGroup* group = expert ? expert_replicas_ : &dp_;
    if (!group || group->size() == 1) continue;  // experts no other rank holds
    in_flight_.push_back(
        group->all_reduce(grads_ + lo, grads_ + lo, static_cast<size_t>(hi - lo), DType::F32, comm::ReduceOp::kSum));
  }
}

void GradBuckets::finish() {
  ready_from(0);
  for (auto& w : in_flight_) w.wait();
  in_flight_.clear();
}

}  // namespace loom::parallel
