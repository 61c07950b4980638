// The CPU backend: oneDNN matmuls plus Loom's OpenMP/AVX kernels, on `threads` OpenMP threads.
#pragma once

#include "loom/kernels/backend.h"

namespace loom::kernels {

class CpuBackend final : public Backend {
 public:
  // threads <= 0 means "all cores". Sets the OpenMP thread count shared by oneDNN and Loom.
  CpuBackend(Allocator& alloc, profile::Tracer* tracer, int threads);

  Device device() const override { return {}; }
  Allocator& allocator() override { return alloc_; }
  profile::Tracer* tracer() override { return tracer_; }
  std::string describe() const override;
  int threads() const { return threads_; }

  void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b, bool accumulate) override;
  void linear_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& w,
                          const Tensor* b) override;
  Tensor prepare_output_grad(const Tensor& dy, const Tensor* db, const Tensor& w) override;
  Tensor activation_backward_output_grad(Activation act, const Tensor& d_pre, const Tensor& pre, const Tensor& d_act,
                                         const Tensor* db, const Tensor& w) override;
  void grouped_linear_forward(const Tensor& y, const Tensor& x, std::span<const Tensor> w,
                              std::span<const int64_t> offsets) override;
  void grouped_linear_backward(const Tensor& dx, std::span<const Tensor> dw, const Tensor& dy, const Tensor& x,
                               std::span<const Tensor> w, std::span<const int64_t> offsets) override;
  void linear_backward(const Tensor* dx, bool dx_accumulate, const Tensor& dw, const Tensor* db, const Tensor& dy,
                       const Tensor& x, const Tensor& w) override;
  void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) override;
  void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) override;
  void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                         const Tensor& b, float eps) override;
  void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                          const Tensor& w, const Tensor& mean, const Tensor& rstd) override;
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) override;
  void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& rstd) override;
  void gelu_forward(const Tensor& out, const Tensor& x) override;
  void gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout) override;
  void swiglu_forward(const Tensor& out, const Tensor& gate_up) override;
  void swiglu_backward(const Tensor& dgate_up, const Tensor& gate_up, const Tensor& dout) override;
  void rope_forward(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const AttentionShape& s) override;
  void rope_backward(const Tensor& dqkv, const Tensor& cos, const Tensor& sin, const AttentionShape& s) override;
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                          const Tensor& qkv, const AttentionShape& s) override;
  void attention_block_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& kv,
                               const AttentionShape& s) override;
  void attention_block_backward(const Tensor& dq, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                const Tensor& lse, const Tensor& q, const Tensor& kv, const AttentionShape& s) override;
  void attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        const DecodeShape& s) override;
  void softmax_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                             float grad_scale) override;
  void cross_entropy_forward(const Tensor& losses, const Tensor& logits, const Tensor& targets) override;
  void vocab_parallel_partials(const Tensor& partials, const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                               int64_t vocab_size, bool keep_exp) override;
  void vocab_parallel_finish(const Tensor& losses, const Tensor& logits, bool write_grad, const Tensor& targets, const Tensor& gathered,
                             int rank, int64_t vocab_size, float grad_scale) override;
  void cast(const Tensor& out, const Tensor& in) override;
  void add(const Tensor& out, const Tensor& a, const Tensor& b) override;

 private:
  // Grow-only scratch for the bf16 copy of a gradient: allocating it per call would pay the page
  // faults of a fresh mapping (tens of MB for the LM head) on every backward pass.
  void* scratch(size_t bytes);
  // linear_forward and linear_forward_add: one GEMM, with C accumulated into or a residual added.
  void linear_forward_gemm(const Tensor& y, const Tensor* residual, const Tensor& x, const Tensor& w, const Tensor* b,
                           bool accumulate);

  Allocator& alloc_;
  profile::Tracer* tracer_;
  int threads_;
  Buffer scratch_;
};

}  // namespace loom::kernels
