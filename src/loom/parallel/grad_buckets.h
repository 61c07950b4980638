// Data-parallel gradient reduction in buckets, overlapped with backward. The gradient arena is laid out
// in forward order (spec::ParamTable), and backward finishes parameters from the end of the arena
// towards its start, so "everything from element `ready_from` on is final" describes readiness. Buckets
// are contiguous arena ranges of about `bucket_bytes`, cut at parameter boundaries, formed from the
// end; each is all-reduced (sum) on the dp group's progress thread as soon as it is final, while the
// backward of earlier layers goes on. Under expert parallelism buckets are also cut where the routed
// experts' weights begin and end: those are reduced over the ranks holding the same experts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/spec/param_table.h"

namespace loom::parallel {

class GradBuckets {
 public:
  // bucket_bytes = 0: one bucket, reduced when the whole gradient is final (no overlap).
  // experts_split: the table's expert weights (ParamSpec::expert) reduce over `expert_replicas` (nullptr
  // or a group of one: no other rank holds them -- nothing to reduce).
  GradBuckets(const spec::ParamTable& table, float* grads, comm::ProcessGroup& dp, size_t bucket_bytes,
              bool experts_split = false, comm::ProcessGroup* expert_replicas = nullptr);

  // Starts a step's reduction: nothing is final yet.
  void begin();
  // Gradients of elements [first, total) are final: issues every bucket that lies wholly inside.
  void ready_from(int64_t first);
  // Issues what is left and waits for every bucket (rethrows a collective's error).
  void finish();

  size_t buckets() const { return bounds_.size(); }
  size_t issued() const { return next_; }  // buckets handed to the dp group this step
  int64_t bucket_begin(size_t i) const { return bounds_[i].first; }

 private:
  float* grads_;
  comm::ProcessGroup& dp_;
  int64_t total_;
  comm::ProcessGroup* expert_replicas_;
  struct Bucket {
    int64_t first, second;  // [lo, hi)
    bool expert;
  };
  std::vector<Bucket> bounds_;  // ordered from the arena's end
  size_t next_ = 0;                                  // first bucket not yet issued
  std::vector<comm::Work> in_flight_;
};

}  // namespace loom::parallel
