// The op interface between a transformer block and where its attention core runs: over the whole
// sequence on this rank (AttentionOps itself), or across a context-parallel group that splits every
// sample's tokens (parallel::ContextParallelAttention: ring or all-to-all), so the model stays free of
// communication. The block applies the rotary embedding first (with its tokens' global positions)
// and hands over qkv [B, T, (H + 2 KVH) D] of the T tokens this rank holds.
#pragma once

#include "loom/kernels/backend.h"

namespace loom::kernels {

class AttentionOps {
 public:
  explicit AttentionOps(Backend& backend) : be_(backend) {}
  virtual ~AttentionOps() = default;
  AttentionOps(const AttentionOps&) = delete;
  AttentionOps& operator=(const AttentionOps&) = delete;

  // The context-parallel group: its size and this rank's place (1 and 0 here). Rank r holds the
  // tokens spec::context_positions(T x size, size, r) of every sample.
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  // out [B, T, H D] and the softmax statistics from qkv, s being this rank's shape (T its tokens).
  // Implementations may leave qkv and lse in a layout of their own (what backward and recompute read).
  virtual void forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
    be_.attention_forward(out, lse, qkv, s);
  }
  // out and lse again from what forward left in qkv (selective recompute: the rotary embedding is not
  // applied twice).
  virtual void recompute(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
    forward(out, lse, qkv, s);
  }
  // Called by the block at the start of its backward (after any recompute, before its MLP's backward),
  // so that an implementation can start moving what backward() will read while the MLP's gradients are
  // computed. backward() follows with the same qkv and shape.
  virtual void prepare_backward(const Tensor& qkv, const AttentionShape& s) {
    (void)qkv, (void)s;
  }
  // dqkv [B, T, (H + 2 KVH) D] in this rank's token layout (written, not accumulated).
  virtual void backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                        const AttentionShape& s) {
    be_.attention_backward(dqkv, dout, out, lse, qkv, s);
  }

 protected:
  Backend& be_;
};

}  // namespace loom::kernels
