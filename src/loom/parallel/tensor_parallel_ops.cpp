#include "loom/parallel/tensor_parallel_ops.h"

#include <chrono>
#include <cstring>

#include "loom/error.h"

namespace loom::parallel {

TensorParallelOps::TensorParallelOps(kernels::Backend& backend, comm::ProcessGroup& tp)
    : kernels::LayerOps(backend), tp_(tp), rank_(tp.rank()), size_(tp.size()) {}

Tensor TensorParallelOps::scratch(Slot slot, const Shape& shape, DType dtype) {
  Tensor& t = scratch_[slot];
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  if (!t.defined() || t.nbytes() < bytes)
    t = Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::F32, be_.allocator(), MemCategory::Activations);
  return Tensor::wrap(t.raw(), shape, dtype);
}

void TensorParallelOps::all_reduce(const Tensor& t, const char* what) {
  profile::Span span(be_.tracer(), what, profile::Category::Communication, 0, static_cast<double>(t.nbytes()));
  const auto t0 = std::chrono::steady_clock::now();
  tp_.all_reduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), DType::F32, comm::ReduceOp::kSum).wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void TensorParallelOps::sum_shared_rows(const Tensor& grad, int64_t begin, int64_t end, int shared_by,
                                        const Tensor& saved) {
  const int64_t cols = grad.numel() / grad.dim(0), n = (end - begin) * cols;
  float* g = grad.data<float>() + begin * cols;
  Tensor all = scratch(kSharedGathered, {size_ * n}, DType::F32);
  {
    profile::Span span(be_.tracer(), "tp_kv_grad_all_gather", profile::Category::Communication, 0, 4.0 * n * size_);
    const auto t0 = std::chrono::steady_clock::now();
    tp_.all_gather(g, all.raw(), static_cast<size_t>(n), DType::F32).wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Ranks first .. first + shared_by - 1 hold the same piece; each sums their parts in rank order, so all
  // of them get the same bits.
  const int first = rank_ / shared_by * shared_by;
  const float* a = all.data<float>();
  const float* s = saved.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int r = first; r < first + shared_by; ++r) sum += a[r * n + i];
    g[i] = s[i] + sum;
  }
}

void TensorParallelOps::column_backward(const Tensor* dx, const kernels::LinearWeights& l, const Tensor& dy,
                                        const Tensor& x) {
  const bool shared = l.shared_by > 1 && l.shared_end > l.shared_begin;
  // The shared rows' gradient accumulates across micro-batches: keep what it held, let the GEMM write
  // this micro-batch's part alone, sum that over the sharing ranks, add back.
  auto save = [&](const Tensor& g, Slot slot) {
    const int64_t cols = g.numel() / g.dim(0), n = (l.shared_end - l.shared_begin) * cols;
    Tensor keep = scratch(slot, {n}, DType::F32);
    float* rows = g.data<float>() + l.shared_begin * cols;
    std::memcpy(keep.raw(), rows, static_cast<size_t>(n) * sizeof(float));
    std::memset(rows, 0, static_cast<size_t>(n) * sizeof(float));
    return keep;
  };
  Tensor saved_w, saved_b;
  if (shared) {
    saved_w = save(l.dw, kShared);
    if (l.has_bias()) saved_b = save(l.db, kSharedBias);
  }
  LayerOps::column_backward(dx, l, dy, x);
  if (shared) {
    sum_shared_rows(l.dw, l.shared_begin, l.shared_end, l.shared_by, saved_w);
    if (l.has_bias()) sum_shared_rows(l.db, l.shared_begin, l.shared_end, l.shared_by, saved_b);
  }
  if (dx) all_reduce(*dx, "tp_all_reduce_dx");
}

void TensorParallelOps::row_forward_add(const Tensor& y, const Tensor& x, const kernels::LinearWeights& l) {
  // Each rank's partial product, the bias on rank 0 only, summed over the group, then added to the
  // residual stream y (which every rank holds whole).
  Tensor partial = scratch(kPartial, y.shape(), DType::F32);
  be_.linear_forward(partial, x, l.w, l.has_bias() && rank_ == 0 ? &l.b : nullptr, false);
  all_reduce(partial, "tp_all_reduce_out");
  be_.add(y, y, partial);
}

Tensor TensorParallelOps::local_tokens(const Tensor& tokens, int64_t rows) {
  Tensor local = scratch(kTokens, tokens.shape(), DType::I32);
  const int64_t begin = rank_ * rows;
  const int32_t* t = tokens.data<int32_t>();
  int32_t* o = local.data<int32_t>();
  for (int64_t i = 0; i < tokens.numel(); ++i)
    o[i] = t[i] >= begin && t[i] < begin + rows ? static_cast<int32_t>(t[i] - begin) : -1;
  return local;
}

void TensorParallelOps::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte,
                                          const Tensor* wpe) {
  // The position rows are added on rank 0 only, so the sum over the group holds them once.
  be_.embedding_forward(out, local_tokens(tokens, wte.dim(0)), wte, rank_ == 0 ? wpe : nullptr);
  all_reduce(out, "tp_all_reduce_embedding");
}

void TensorParallelOps::embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout,
                                           const Tensor& tokens) {
  // dout is whole on every rank: each adds into its own vocabulary rows, and every rank computes the
  // same (replicated) position gradient.
  be_.embedding_backward(dwte, dwpe, dout, local_tokens(tokens, dwte.dim(0)));
}

void TensorParallelOps::cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                      int64_t vocab_size, float grad_scale) {
  const int64_t N = logits.dim(0), V = logits.dim(1);
  const bool train = grad_scale > 0;
  Tensor stats = scratch(kRowStats, {N, 3}, DType::F32);
  Tensor all = scratch(kGathered, {size_ * N, 3}, DType::F32);
  be_.vocab_parallel_partials(stats, logits, targets, rank_ * V, vocab_size, train);
  {
    profile::Span span(be_.tracer(), "tp_all_gather_xent", profile::Category::Communication, 0, 12.0 * N * size_);
    const auto t0 = std::chrono::steady_clock::now();
    tp_.all_gather(stats.raw(), all.raw(), static_cast<size_t>(3 * N), DType::F32).wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  be_.vocab_parallel_finish(losses, logits, train, targets, all, rank_, vocab_size, grad_scale);
}

}  // namespace loom::parallel
