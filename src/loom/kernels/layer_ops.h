// The op interface between the transformer and the shard of the model this rank holds. The model runs
// every linear, the embedding and the loss through it; LayerOps itself runs them on the whole model,
// and parallel::TensorParallelOps (built by parallel::parallelize) adds the tensor-parallel collectives,
// so the model stays free of communication. Names follow Megatron-LM:
//   column-parallel linear: the input is whole on every rank, the output features are split;
//   row-parallel linear:    the input features are split, the output is the sum over the group.
// With sequence parallelism the whole-input / summed-output sides become all-gather / reduce-scatter
// along the sequence: the same four calls, other collectives.
#pragma once

#include <cstdint>

#include "loom/kernels/backend.h"

namespace loom::kernels {

// A linear layer's views: the weight as GEMMs read it (bf16 copy in bf16 mode), its f32 gradient, and
// optionally a bias (GPT-2). Rows [shared_begin, shared_end) of the weight (and bias) are a piece that
// `shared_by` consecutive tensor-parallel ranks hold alike (grouped-query KV heads at tp > n_kv_heads):
// their gradients are summed over those ranks, so the replicas stay equal.
struct LinearWeights {
  Tensor w, dw, b, db;
  int64_t shared_begin = 0, shared_end = 0;
  int shared_by = 1;
  bool has_bias() const { return b.defined(); }
};

class LayerOps {
 public:
  explicit LayerOps(Backend& backend) : be_(backend) {}
  virtual ~LayerOps() = default;
  LayerOps(const LayerOps&) = delete;
  LayerOps& operator=(const LayerOps&) = delete;

  Backend& backend() const { return be_; }
  // This rank's place in the tensor-parallel group (0 of 1 for the whole model).
  virtual int rank() const { return 0; }
  virtual int size() const { return 1; }
  // Into how many runs the residual stream's token rows are split: 1, or tp under sequence parallelism
  // (rank r holds rows [r N / tp, (r + 1) N / tp) of a micro-batch's N = B x T: norms, residual adds and the
  // embedding output are computed on those alone).
  virtual int sequence_shards() const { return 1; }
  // Sums `t` over the group in place: under sequence parallelism, the norms' weight gradients of one
  // micro-batch, which each rank computed over its rows only. A no-op otherwise.
  virtual void sum_partial_grads(const Tensor& /*t*/) {}

  // Shapes below are for one micro-batch of N token rows; under sequence parallelism every [N, C] that
  // is the residual stream's (x of column_*, y of row_forward_add, dy of row_backward, the embedding's
  // out) holds this rank's N / tp rows instead.
  // y[N, OC/tp] = x[N, IC] . w^T (+ b).
  virtual void column_forward(const Tensor& y, const Tensor& x, const LinearWeights& l);
  // dx[N, IC] = dy . w summed over the group (skipped when dx is null); dw += dy^T . x; db += sum dy.
  virtual void column_backward(const Tensor* dx, const LinearWeights& l, const Tensor& dy, const Tensor& x);
  // y[N, OC] = residual + sum over the group of x[N, IC/tp] . w^T, plus b once. residual may be y itself
  // (an accumulation); otherwise it is added where the sum is formed (a GEMM's epilogue), never copied.
  virtual void row_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x, const LinearWeights& l);
  // dx[N, IC/tp] = dy . w; dw += dy^T . x; db += sum dy (dy whole on every rank).
  virtual void row_backward(const Tensor& dx, const LinearWeights& l, const Tensor& dy, const Tensor& x);

  // Split backward (zero-bubble pipeline schedules): a linear's input gradient now, its weight (and
  // bias) gradient later, from the same dy and x, which the caller keeps. dx = dy . w; dw += dy^T . x;
  // db += sum dy: column_backward / row_backward in two halves. Only where splits_backward() (the whole
  // model's ops: a tensor-parallel shard's collectives are not split yet).
  virtual bool splits_backward() const { return true; }
  void linear_backward_input(const Tensor& dx, const LinearWeights& l, const Tensor& dy, const Tensor& x);
  void linear_backward_weight(const LinearWeights& l, const Tensor& dy, const Tensor& x);

  // A mixture-of-experts MLP under tensor parallelism runs every token of the micro-batch on every rank
  // (each holds a slice of every expert's width, and all route alike), so it needs the rows whole and
  // sums its partial outputs itself:
  // x [N / shards, ...] of every rank end to end into `whole` [N, ...] and returned (sequence
  // parallelism); without it x is whole already and is returned as is.
  virtual Tensor whole_rows(const Tensor& x, const Tensor& /*whole*/) { return x; }
  // y [N / shards, C] += this rank's rows of partial [N, C] summed over the group (partial is clobbered).
  void add_group_sum(const Tensor& y, const Tensor& partial);
  // y = residual + partial summed over the group (residual may be y).
  virtual void add_group_sum(const Tensor& y, const Tensor& residual, const Tensor& partial);
  // t summed over the group in place (nothing to do alone).
  virtual void sum_over_group(const Tensor& /*t*/) {}

  // out[N, C] = wte[tokens] (+ wpe[position]); wte holds this rank's rows of the vocabulary.
  virtual void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe);
  virtual void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens);
  // Per-row losses over logits [N, V/tp] (this rank's vocabulary columns of a vocab_size vocabulary);
  // with grad_scale > 0 the logits become dlogits * grad_scale, else they are left as they are.
  virtual void cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets, int64_t vocab_size,
                             float grad_scale);

 protected:
  Backend& be_;
};

}  // namespace loom::kernels
