// Megatron-LM tensor parallelism as a kernels::LayerOps: the transformer's linears, embedding and loss
// over one tp group, each rank holding its shard of every weight (spec::build_param_table with its
// TableShard).
//   column-parallel linear: forward local; backward sums the input gradient over the group (all-reduce).
//   row-parallel linear:    forward sums the partial outputs over the group (all-reduce), bias once.
//   embedding:              vocabulary-parallel rows; each rank looks up its own tokens, the rows summed.
//   cross-entropy:          vocabulary-parallel, one all-gather of [N, 3] per-row partials: the full
//                           logits are never gathered.
// KV rows that several ranks share (kv_heads < tp) get their weight gradient summed over those ranks.
// Every collective returns the same bits on every rank, so replicated state stays bitwise equal.
#pragma once

#include <array>

#include "loom/comm/process_group.h"
#include "loom/kernels/layer_ops.h"

namespace loom::parallel {

class TensorParallelOps : public kernels::LayerOps {
 public:
  TensorParallelOps(kernels::Backend& backend, comm::ProcessGroup& tp);

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void column_backward(const Tensor* dx, const kernels::LinearWeights& l, const Tensor& dy, const Tensor& x) override;
  void row_forward_add(const Tensor& y, const Tensor& x, const kernels::LinearWeights& l) override;
  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) override;
  void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) override;
  void cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                     float grad_scale) override;

  // Wall seconds this thread waited on the group's collectives (cumulative): exposed TP communication.
  double wait_seconds() const { return wait_seconds_; }

 private:
  enum Slot { kPartial, kTokens, kRowStats, kGathered, kShared, kSharedBias, kSharedGathered, kSlots };
  // A reusable scratch tensor of at least `numel` elements, viewed as `shape`.
  Tensor scratch(Slot slot, const Shape& shape, DType dtype);
  void all_reduce(const Tensor& t, const char* what);
  // Tokens of this rank's vocabulary rows [begin, begin + rows) as local indices, the others -1.
  Tensor local_tokens(const Tensor& tokens, int64_t rows);
  // Sums this micro-batch's gradient of the shared rows over the ranks that share them.
  void sum_shared_rows(const Tensor& grad, int64_t begin, int64_t end, int shared_by, const Tensor& saved);

  comm::ProcessGroup& tp_;
  int rank_, size_;
  std::array<Tensor, kSlots> scratch_;
  double wait_seconds_ = 0;
};

}  // namespace loom::parallel
