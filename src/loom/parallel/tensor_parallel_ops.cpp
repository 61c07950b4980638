#include "loom/parallel/tensor_parallel_ops.h"

#include <cstring>
#include <vector>

#include "loom/error.h"

namespace loom::parallel {

using profile::Tracer;

TensorParallelOps::TensorParallelOps(kernels::Backend& backend, comm::ProcessGroup& tp, TensorParallelOptions options)
    : kernels::LayerOps(backend),
      tp_(tp),
      rank_(tp.rank()),
      size_(tp.size()),
      options_(options),
      in_flight_(backend) {}

Tensor TensorParallelOps::scratch(Slot slot, const Shape& shape, DType dtype) {
  Tensor& t = scratch_[slot];
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  if (!t.defined() || t.nbytes() < bytes)
    t = Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::F32, be_.allocator(), MemCategory::Activations);
  return Tensor::wrap(t.raw(), shape, dtype);
}

void TensorParallelOps::all_reduce(const Tensor& t, const char* name, const char* wait_name) {
  Pending p = issue(tp_.all_reduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), t.dtype(), comm::ReduceOp::kSum),
                    name, wait_name, static_cast<double>(t.nbytes()));
  wait(p);
}

Tensor TensorParallelOps::gather_rows(const Tensor& x, Slot slot, const char* name, const char* wait_name) {
  Tensor whole = scratch(slot, {x.dim(0) * size_, x.numel() / x.dim(0)}, x.dtype());
  Pending p = issue(tp_.all_gather(x.raw(), whole.raw(), static_cast<size_t>(x.numel()), x.dtype()), name, wait_name,
                    static_cast<double>(whole.nbytes()));
  wait(p);
  return whole;
}

void TensorParallelOps::sum_partial_grads(const Tensor& t) {
  if (options_.sequence_parallel) all_reduce(t, "tp_all_reduce_norm_grads", "tp_all_reduce_norm_grads.wait");
}

void TensorParallelOps::sum_shared_rows(const Tensor& grad, int64_t begin, int64_t end, int shared_by,
                                        const Tensor& saved) {
  const int64_t cols = grad.numel() / grad.dim(0), n = (end - begin) * cols;
  float* g = grad.data<float>() + begin * cols;
  Tensor all = scratch(kSharedGathered, {size_ * n}, DType::F32);
  Pending p = issue(tp_.all_gather(g, all.raw(), static_cast<size_t>(n), DType::F32), "tp_all_gather_kv_grad",
                    "tp_all_gather_kv_grad.wait", 4.0 * static_cast<double>(n * size_));
  wait(p);
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

void TensorParallelOps::column_forward(const Tensor& y, const Tensor& x, const kernels::LinearWeights& l) {
  if (!options_.sequence_parallel) return LayerOps::column_forward(y, x, l);
  const int64_t rows = x.dim(0), cols = x.numel() / rows;
  // With overlap the gather goes in chunks of this rank's rows, all issued at once; the GEMM of each
  // chunk's rows (from every rank) runs as soon as that chunk has landed, while the next is in flight.
  const int64_t chunks = options_.overlap && rows >= 2 * kMinChunkRows ? 2 : 1;
  if (chunks == 1) {
    const Tensor whole = gather_rows(x, kGatherX, "tp_all_gather_x", "tp_all_gather_x.wait");
    return LayerOps::column_forward(y, whole, l);
  }
  // Chunk j covers this rank's rows [begin_j, end_j); gathered, it holds every rank's rows of it, rank
  // by rank, at gathered rows [size * begin_j, size * end_j).
  Tensor whole = scratch(kGatherX, {rows * size_, cols}, x.dtype());
  auto bound = [&](int64_t j) { return rows * j / chunks; };
  std::vector<Pending> pending;
  for (int64_t j = 0; j < chunks; ++j) {
    const Tensor part = x.slice(bound(j), bound(j + 1));
    const Tensor into = whole.slice(size_ * bound(j), size_ * bound(j + 1));
    pending.push_back(issue(tp_.all_gather(part.raw(), into.raw(), static_cast<size_t>(part.numel()), x.dtype()),
                            "tp_all_gather_x_chunk", "tp_all_gather_x_chunk.wait", static_cast<double>(into.nbytes())));
  }
  const Tensor* bias = l.has_bias() ? &l.b : nullptr;
  for (int64_t j = 0; j < chunks; ++j) {
    wait(pending[static_cast<size_t>(j)]);
    const int64_t n = bound(j + 1) - bound(j);
    for (int r = 0; r < size_; ++r) {
      // Rank r's rows of chunk j are its rows [begin_j, end_j), i.e. rows r * rows + begin_j ... of y.
      const Tensor in = whole.slice(size_ * bound(j) + r * n, size_ * bound(j) + (r + 1) * n);
      be_.linear_forward(y.slice(r * rows + bound(j), r * rows + bound(j + 1)), in, l.w, bias, false);
    }
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
  const Tensor* db = l.has_bias() ? &l.db : nullptr;
  const bool overlap = options_.overlap;
  if (options_.sequence_parallel) {
    // The input is sharded by rows: gather it again (the forward's copy was not kept), computing the input
    // gradient meanwhile (it does not read the input); then reduce-scatter the input gradient back to
    // this rank's rows while the weight gradient is computed.
    Tensor whole = scratch(kGatherX, {x.dim(0) * size_, x.numel() / x.dim(0)}, x.dtype());
    Pending gather = issue(tp_.all_gather(x.raw(), whole.raw(), static_cast<size_t>(x.numel()), x.dtype()),
                           "tp_all_gather_x", "tp_all_gather_x.wait", static_cast<double>(whole.nbytes()));
    Tensor dx_whole = dx ? scratch(kDxWhole, {whole.dim(0), whole.dim(1)}, DType::F32) : Tensor();
    const Tensor g = be_.prepare_output_grad(dy, db, l.w);  // cast once for both halves, with the bias grad
    if (!overlap) wait(gather);
    if (dx) be_.linear_backward(&dx_whole, false, Tensor(), nullptr, g, whole, l.w);
    if (overlap) wait(gather);
    Pending scatter;
    if (dx)
      scatter = issue(tp_.reduce_scatter(dx_whole.raw(), dx->raw(), static_cast<size_t>(dx->numel()), DType::F32),
                      "tp_reduce_scatter_dx", "tp_reduce_scatter_dx.wait", static_cast<double>(dx_whole.nbytes()));
    if (dx && !overlap) wait(scatter);
    be_.linear_backward(nullptr, false, l.dw, nullptr, g, whole, l.w);
    if (dx && overlap) wait(scatter);
  } else if (dx && overlap) {
    // The input gradient first, summed over the group while the weight gradient is computed.
    const Tensor g = be_.prepare_output_grad(dy, db, l.w);
    be_.linear_backward(dx, false, Tensor(), nullptr, g, x, l.w);
    Pending sum = issue(tp_.all_reduce(dx->raw(), dx->raw(), static_cast<size_t>(dx->numel()), DType::F32),
                        "tp_all_reduce_dx", "tp_all_reduce_dx.wait", static_cast<double>(dx->nbytes()));
    be_.linear_backward(nullptr, false, l.dw, nullptr, g, x, l.w);
    wait(sum);
  } else {
    LayerOps::column_backward(dx, l, dy, x);
    if (dx) all_reduce(*dx, "tp_all_reduce_dx", "tp_all_reduce_dx.wait");
  }
  if (shared) {
    sum_shared_rows(l.dw, l.shared_begin, l.shared_end, l.shared_by, saved_w);
    if (l.has_bias()) sum_shared_rows(l.db, l.shared_begin, l.shared_end, l.shared_by, saved_b);
  }
}

void TensorParallelOps::row_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x,
                                        const kernels::LinearWeights& l) {
  // Each rank's partial product, the bias on rank 0 only, summed over the group (under SP scattered to
  // the rows each rank holds), then added to the residual stream into y.
  Tensor partial = scratch(kPartial, {x.dim(0), l.w.dim(0)}, DType::F32);
  be_.linear_forward(partial, x, l.w, l.has_bias() && rank_ == 0 ? &l.b : nullptr, false);
  add_group_sum(y, residual, partial);
}

void TensorParallelOps::add_group_sum(const Tensor& y, const Tensor& residual, const Tensor& partial) {
  if (!options_.sequence_parallel) {
    all_reduce(partial, "tp_all_reduce_out", "tp_all_reduce_out.wait");
    be_.add(y, residual, partial);
    return;
  }
  Tensor mine = scratch(kRowsOut, y.shape(), DType::F32);
  Pending p = issue(tp_.reduce_scatter(partial.raw(), mine.raw(), static_cast<size_t>(mine.numel()), DType::F32),
                    "tp_reduce_scatter_out", "tp_reduce_scatter_out.wait", static_cast<double>(partial.nbytes()));
  wait(p);
  be_.add(y, residual, mine);
}

Tensor TensorParallelOps::whole_rows(const Tensor& x, const Tensor& whole) {
  if (!options_.sequence_parallel) return x;
  Pending p = issue(tp_.all_gather(x.raw(), whole.raw(), static_cast<size_t>(x.numel()), x.dtype()), "tp_all_gather_moe",
                    "tp_all_gather_moe.wait", static_cast<double>(whole.nbytes()));
  wait(p);
  return whole;
}

void TensorParallelOps::sum_over_group(const Tensor& t) { all_reduce(t, "tp_all_reduce_moe", "tp_all_reduce_moe.wait"); }

void TensorParallelOps::row_backward(const Tensor& dx, const kernels::LinearWeights& l, const Tensor& dy,
                                     const Tensor& x) {
  if (!options_.sequence_parallel) return LayerOps::row_backward(dx, l, dy, x);
  LayerOps::row_backward(dx, l, gather_rows(dy, kGatherDy, "tp_all_gather_dy", "tp_all_gather_dy.wait"), x);
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
  const Tensor* pos = rank_ == 0 ? wpe : nullptr;
  if (!options_.sequence_parallel) {
    be_.embedding_forward(out, local_tokens(tokens, wte.dim(0)), wte, pos);
    all_reduce(out, "tp_all_reduce_embedding", "tp_all_reduce_embedding.wait");
    return;
  }
  Tensor whole = scratch(kPartial, {tokens.numel(), wte.dim(1)}, DType::F32);
  be_.embedding_forward(whole, local_tokens(tokens, wte.dim(0)), wte, pos);
  Pending p = issue(tp_.reduce_scatter(whole.raw(), out.raw(), static_cast<size_t>(out.numel()), DType::F32),
                    "tp_reduce_scatter_embedding", "tp_reduce_scatter_embedding.wait",
                    static_cast<double>(whole.nbytes()));
  wait(p);
}

void TensorParallelOps::embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout,
                                           const Tensor& tokens) {
  // Every rank needs the whole output gradient: each adds into its own vocabulary rows, and every rank
  // computes the same (replicated) position gradient.
  const Tensor whole = options_.sequence_parallel
                           ? gather_rows(dout, kGatherDy, "tp_all_gather_dembedding", "tp_all_gather_dembedding.wait")
                           : dout;
  be_.embedding_backward(dwte, dwpe, whole, local_tokens(tokens, dwte.dim(0)));
}

void TensorParallelOps::cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                      int64_t vocab_size, float grad_scale) {
  const int64_t N = logits.dim(0), V = logits.dim(1);
  const bool train = grad_scale > 0;
  Tensor stats = scratch(kRowStats, {N, 3}, DType::F32);
  Tensor all = scratch(kGathered, {size_ * N, 3}, DType::F32);
  be_.vocab_parallel_partials(stats, logits, targets, rank_ * V, vocab_size, train);
  Pending p = issue(tp_.all_gather(stats.raw(), all.raw(), static_cast<size_t>(3 * N), DType::F32),
                    "tp_all_gather_xent", "tp_all_gather_xent.wait", static_cast<double>(all.nbytes()));
  wait(p);
  be_.vocab_parallel_finish(losses, logits, train, targets, all, rank_, vocab_size, grad_scale);
}

}  // namespace loom::parallel
