// Megatron-LM tensor parallelism, with optional sequence parallelism, as a kernels::LayerOps: the
// transformer's linears, embedding and loss over one tp group, each rank holding its shard of every
// weight (spec::build_param_table with its TableShard).
//   column-parallel linear: forward local; backward sums the input gradient over the group (all-reduce;
//                           under SP the input is all-gathered first and the input gradient
//                           reduce-scattered back to this rank's rows).
//   row-parallel linear:    forward sums the partial outputs over the group (all-reduce; under SP
//                           reduce-scatter), bias once; under SP backward all-gathers the output gradient.
//   embedding:              vocabulary-parallel rows; each rank looks up its own tokens, the rows summed
//                           (under SP reduce-scattered).
//   cross-entropy:          vocabulary-parallel, one all-gather of [N, 3] per-row partials: the full
//                           logits are never gathered.
// KV rows that several ranks share (kv_heads < tp) get their weight gradient summed over those ranks.
// Mixture-of-experts blocks gather their rows whole and sum their partial outputs through the same
// group (whole_rows, add_group_sum, sum_over_group; model/moe_layer.cpp).
// With overlap on, the input-gradient collective of a column-parallel backward (and under SP the
// re-gather of its input) runs while a GEMM that does not need it does, and under SP the forward's input
// gather goes in two chunks, the GEMM of the first chunk's rows running while the second is in flight. Every collective returns the
// same bits on every rank, so replicated state stays bitwise equal.
#pragma once

#include <array>
#include <cstdint>

#include "loom/comm/process_group.h"
#include "loom/kernels/layer_ops.h"
#include "loom/parallel/in_flight.h"

namespace loom::parallel {

struct TensorParallelOptions {
  bool sequence_parallel = false;
  bool overlap = true;
};

class TensorParallelOps : public kernels::LayerOps {
 public:
  TensorParallelOps(kernels::Backend& backend, comm::ProcessGroup& tp, TensorParallelOptions options = {});

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int sequence_shards() const override { return options_.sequence_parallel ? size_ : 1; }
  void sum_partial_grads(const Tensor& t) override;
  bool splits_backward() const override { return false; }

  void column_forward(const Tensor& y, const Tensor& x, const kernels::LinearWeights& l) override;
  void column_backward(const Tensor* dx, const kernels::LinearWeights& l, const Tensor& dy, const Tensor& x) override;
  void row_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x,
                       const kernels::LinearWeights& l) override;
  void row_backward(const Tensor& dx, const kernels::LinearWeights& l, const Tensor& dy, const Tensor& x) override;
  Tensor whole_rows(const Tensor& x, const Tensor& whole) override;
  using kernels::LayerOps::add_group_sum;
  void add_group_sum(const Tensor& y, const Tensor& residual, const Tensor& partial) override;
  void sum_over_group(const Tensor& t) override;
  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) override;
  void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) override;
  void cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                     float grad_scale) override;

  // Wall seconds this thread waited on the group's collectives (cumulative): exposed TP communication.
  double wait_seconds() const { return in_flight_.wait_seconds(); }
  // Wall seconds asynchronous collectives were in flight, from issue to completion (cumulative).
  double in_flight_seconds() const { return in_flight_.in_flight_seconds(); }

 private:
  // Below this many rows per chunk the SP input gather of a column-parallel forward is not chunked (a
  // GEMM that small runs below its rate).
  static constexpr int64_t kMinChunkRows = 128;
  enum Slot {
    kPartial, kGatherX, kGatherDy, kDxWhole, kRowsOut, kTokens, kRowStats, kGathered, kShared, kSharedBias,
    kSharedGathered, kSlots
  };
  // A reusable scratch tensor of at least the shape's size, viewed as `shape`.
  Tensor scratch(Slot slot, const Shape& shape, DType dtype);
  // A collective issued now and waited for later; `name` and `wait_name` are its trace spans
  // (profile::Category::InFlight and its ".wait").
  using Pending = InFlight::Pending;
  Pending issue(comm::Work work, const char* name, const char* wait_name, double bytes) {
    return in_flight_.issue(std::move(work), name, wait_name, bytes);
  }
  void wait(Pending& p) { in_flight_.wait(p); }
  // Blocking collectives (issue + wait).
  void all_reduce(const Tensor& t, const char* name, const char* wait_name);
  // Under SP: x [N / tp, ...] of every rank laid end to end -> [N, ...] (any dtype).
  Tensor gather_rows(const Tensor& x, Slot slot, const char* name, const char* wait_name);
  // Tokens of this rank's vocabulary rows [begin, begin + rows) as local indices, the others -1.
  Tensor local_tokens(const Tensor& tokens, int64_t rows);
  // Sums this micro-batch's gradient of the shared rows over the ranks that share them.
  void sum_shared_rows(const Tensor& grad, int64_t begin, int64_t end, int shared_by, const Tensor& saved);

  comm::ProcessGroup& tp_;
  int rank_, size_;
  TensorParallelOptions options_;
  std::array<Tensor, kSlots> scratch_;
  InFlight in_flight_;
};

}  // namespace loom::parallel
