// The device-backend interface: the operations the model and trainer run, on Tensors. The CPU backend
// implements them with oneDNN GEMMs and Loom's own kernels; a CUDA backend would add a
// subclass, not change callers. Each operation opens a trace span carrying its FLOPs and bytes.
// Kept as small as the model needs: no speculative methods.
#pragma once

#include <span>
#include <string>

#include "loom/core/tensor.h"
#include "loom/kernels/attention.h"
#include "loom/kernels/attention_decode.h"
#include "loom/profile/tracer.h"

namespace loom::kernels {

// The MLP's activation (GPT-2: GELU; Llama: SwiGLU over gate|up).
enum class Activation { Gelu, SwiGLU };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual Allocator& allocator() = 0;
  virtual profile::Tracer* tracer() = 0;
  // One line for start-up logs: ISA, threads, GEMM implementations, bf16 mode.
  virtual std::string describe() const = 0;

  // y[N,OC] (+)= x[N,IC] . w[OC,IC]^T (+ b[OC]); x and w both f32 or both bf16; y, b f32.
  virtual void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b,
                              bool accumulate) = 0;
  // y[N,OC] = residual[N,OC] + x . w^T (+ b): a residual connection added in the GEMM's epilogue (no
  // copy of it into y first). residual f32, and not y itself (then use linear_forward's accumulate).
  virtual void linear_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& w,
                                  const Tensor* b) = 0;
  // dx (+)= dy . w (skipped when dx is null); dw += dy^T . x (skipped when dw is undefined: then x is
  // not read, only its shape checked); db += column sums of dy (when non-null). dy is f32, or what
  // prepare_output_grad returned (then db is null: the bias gradient was taken there). When x and w are
  // bf16, an f32 dy is rounded to bf16 once for both GEMMs, in the pass that also sums db.
  virtual void linear_backward(const Tensor* dx, bool dx_accumulate, const Tensor& dw, const Tensor* db,
                               const Tensor& dy, const Tensor& x, const Tensor& w) = 0;
  // For a backward split in two calls (input gradient first, so a collective on dx runs while the
  // weight gradient is computed): dy in the precision of w's GEMMs, cast once (bf16 weights) with
  // db += column sums of dy taken in the same pass (when non-null). Pass the result as dy to both
  // linear_backward calls, with no db. It lives in the backend's scratch until its next cast of an
  // output gradient (f32 weights: dy itself).
  virtual Tensor prepare_output_grad(const Tensor& dy, const Tensor* db, const Tensor& w) = 0;
  // The MLP activation's backward fused with prepare_output_grad for the linear before it (weights w,
  // whose output `pre` is: GELU's input, or SwiGLU's gate|up): for bf16 weights one pass computes the
  // gradient, rounds it to bf16 and sums db (GELU's bias; when non-null), never storing it in f32;
  // for f32 weights the plain backward writes d_pre and prepare_output_grad follows. Returns what
  // prepare_output_grad returns; pass it as dy, with no bias gradient, to that linear's backward.
  virtual Tensor activation_backward_output_grad(Activation act, const Tensor& d_pre, const Tensor& pre,
                                                 const Tensor& d_act, const Tensor* db, const Tensor& w) = 0;
  // Grouped linear (a mixture of experts' experts): rows [offsets[g], offsets[g + 1]) of x [M, IC] go
  // through w[g] [OC, IC]: y[rows] = x[rows] . w[g]^T. One GEMM primitive with run-time dimensions
  // serves every group and every step's row counts (gemm.h: no JIT per count); empty groups are skipped.
  virtual void grouped_linear_forward(const Tensor& y, const Tensor& x, std::span<const Tensor> w,
                                      std::span<const int64_t> offsets) = 0;
  // Its backward: dx[rows] = dy[rows] . w[g] (written), dw[g] += dy[rows]^T . x[rows]. dy is f32, cast
  // once for all groups when the weights are bf16.
  virtual void grouped_linear_backward(const Tensor& dx, std::span<const Tensor> dw, const Tensor& dy,
                                       const Tensor& x, std::span<const Tensor> w, std::span<const int64_t> offsets) = 0;

  virtual void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) = 0;
  virtual void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout,
                                  const Tensor& tokens) = 0;
  virtual void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                 const Tensor& w, const Tensor& b, float eps) = 0;
  virtual void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                                  const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd) = 0;
  virtual void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w,
                               float eps) = 0;
  virtual void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                                const Tensor& w, const Tensor& rstd) = 0;
  // out f32, or bf16 (then the cast for the next GEMM is fused in: precision bf16).
  virtual void gelu_forward(const Tensor& out, const Tensor& x) = 0;
  virtual void gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout) = 0;
  virtual void swiglu_forward(const Tensor& out, const Tensor& gate_up) = 0;
  virtual void swiglu_backward(const Tensor& dgate_up, const Tensor& gate_up, const Tensor& dout) = 0;
  virtual void rope_forward(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const AttentionShape& s) = 0;
  virtual void rope_backward(const Tensor& dqkv, const Tensor& cos, const Tensor& sin, const AttentionShape& s) = 0;
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                 const AttentionShape& s) = 0;
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                                  const Tensor& qkv, const AttentionShape& s) = 0;
  // A block of attention with no mask (context parallelism's ring; kernels/attention.h): s.T queries
  // q [B, T, H D] against the Tk = kv.dim(1) keys and values of kv [B, Tk, 2 KVH D].
  virtual void attention_block_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& kv,
                                       const AttentionShape& s) = 0;
  virtual void attention_block_backward(const Tensor& dq, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                        const Tensor& lse, const Tensor& q, const Tensor& kv,
                                        const AttentionShape& s) = 0;
  // Incremental decoding over a KV cache (generation).
  virtual void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                const DecodeShape& s) = 0;
  // Fused softmax + cross-entropy: logits become dlogits * grad_scale, per-row losses written.
  virtual void softmax_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                     float grad_scale) = 0;
  virtual void cross_entropy_forward(const Tensor& losses, const Tensor& logits, const Tensor& targets) = 0;
  // Vocabulary-parallel cross-entropy in two halves around an all-gather of the partials [N, 3] (see
  // kernels::vocab_shard_partials and vocab_shard_finish): logits [N, V] hold vocabulary entries
  // [rank * V, rank * V + V); gathered is [ranks, N, 3]; with write_grad the logits (holding the exp
  // values the partials pass left) become dlogits * grad_scale.
  virtual void vocab_parallel_partials(const Tensor& partials, const Tensor& logits, const Tensor& targets,
                                       int64_t vocab_begin, int64_t vocab_size, bool keep_exp) = 0;
  virtual void vocab_parallel_finish(const Tensor& losses, const Tensor& logits, bool write_grad, const Tensor& targets,
                                     const Tensor& gathered, int rank, int64_t vocab_size, float grad_scale) = 0;
  // f32 -> bf16 (round to nearest even) or bf16 -> f32, by the tensors' dtypes.
  virtual void cast(const Tensor& out, const Tensor& in) = 0;
  virtual void add(const Tensor& out, const Tensor& a, const Tensor& b) = 0;
};

}  // namespace loom::kernels
