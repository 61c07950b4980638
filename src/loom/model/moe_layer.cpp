#include "loom/model/moe_layer.h"

#include <vector>

#include "loom/core/bf16.h"
#include "loom/error.h"
#include "loom/kernels/moe_routing.h"
#include "loom/profile/tracer.h"

namespace loom::model {

MoeActivations make_moe_activations(const spec::TransformerConfig& cfg, int64_t N, bool lowp, Allocator& alloc,
                                    MoeSplit split) {
  const int64_t C = cfg.d_model, E = cfg.moe.experts, k = cfg.moe.top_k, Fe = cfg.expert_width() / split.tp;
  // The expert side: every rank's rows for this rank's experts, bounded by their capacity.
  const int64_t Fs = cfg.moe.shared_experts * Fe, M = N * k, Mx = cfg.moe.expert_side_rows(N, split.ep);
  const int ep = split.ep;
  auto make = [&](Shape s, DType d) { return Tensor::empty(s, d, alloc, MemCategory::Activations); };
  auto f32 = [&](Shape s) { return make(s, DType::F32); };
  const DType gemm = lowp ? DType::BF16 : DType::F32;
  MoeActivations a;
  a.scores = f32({N, E});
  a.expert = make({N, k}, DType::I32), a.weight = f32({N, k}), a.row = make({N, k}, DType::I32);
  a.token_of_row = make({M}, DType::I32);
  a.x = make({M, C}, gemm);
  a.y = f32({M, C});
  a.xe = ep > 1 ? make({Mx, C}, gemm) : a.x;
  a.h_pre = f32({Mx, 2 * Fe}), a.h_act = f32({Mx, Fe}), a.h_act_lp = lowp ? make({Mx, Fe}, gemm) : a.h_act;
  if (Fs > 0) {
    a.shared_pre = f32({N, 2 * Fs}), a.shared_act = f32({N, Fs});
    a.shared_act_lp = lowp ? make({N, Fs}, gemm) : a.shared_act;
  }
  return a;
}

MoeScratch make_moe_scratch(const spec::TransformerConfig& cfg, int64_t N, bool lowp, Allocator& alloc, MoeSplit split) {
  const int64_t C = cfg.d_model, E = cfg.moe.experts, k = cfg.moe.top_k, Fe = cfg.expert_width() / split.tp;
  const int64_t Fs = cfg.moe.shared_experts * Fe, M = N * k, Mx = cfg.moe.expert_side_rows(N, split.ep);
  const int ep = split.ep;
  auto f32 = [&](Shape s) { return Tensor::empty(s, DType::F32, alloc, MemCategory::Activations); };
  MoeScratch s;
  s.dy = f32({M, C}), s.dx = f32({M, C}), s.d_act = f32({Mx, Fe}), s.d_pre = f32({Mx, 2 * Fe});
  if (ep > 1) {
    s.recv_lp = lowp ? Tensor::empty({Mx, C}, DType::BF16, alloc, MemCategory::Activations) : f32({Mx, C});
    s.recv = f32({Mx, C}), s.by_expert = f32({Mx, C});
  }
  s.dweight = f32({N, k}), s.dlogits = f32({N, E});
  if (Fs > 0) s.shared_d_act = f32({N, Fs}), s.shared_d_pre = f32({N, 2 * Fs});
  if (split.tp > 1) {
    s.partial = f32({N, C});
    if (split.sequence_parallel) {
      s.x_whole = f32({N, C}), s.dout_whole = f32({N, C});
      s.x_whole_lp = lowp ? Tensor::empty({N, C}, DType::BF16, alloc, MemCategory::Activations) : s.x_whole;
    }
  }
  return s;
}

MoeLayer::MoeLayer(const spec::TransformerConfig& cfg, kernels::Backend& backend, bool lowp, kernels::LayerOps* ops)
    : cfg_(cfg), be_(backend), lowp_(lowp), ops_(ops) {}

std::pair<Tensor, Tensor> MoeLayer::whole_inputs(const Tensor& x, const Tensor& x_f32, MoeScratch* s) {
  if (!split().sequence_parallel) return {x, x_f32};  // (sequence parallelism implies tp > 1: s is given)
  const int64_t N = x.dim(0) * tp();
  // The f32 rows travel; the GEMM copy is cast here, as the block cast this rank's rows.
  const Tensor f = ops_->whole_rows(x_f32, s->x_whole.slice(0, N));
  if (x.dtype() == DType::F32) return {f, f};
  const Tensor lp = s->x_whole_lp.slice(0, N);
  be_.cast(lp, f);
  return {lp, f};
}

void MoeLayer::run_experts(const MoeWeights& w, MoeActivations& a, const std::vector<int64_t>& offsets,
                           const Tensor& y) {
  // Every expert's rows in one grouped GEMM per projection (an expert no row reached runs nothing).
  const int64_t R = offsets.back();
  if (R == 0) return;
  be_.grouped_linear_forward(a.h_pre, a.xe, w.gate_up, offsets);
  be_.swiglu_forward(a.h_act.slice(0, R), a.h_pre.slice(0, R));
  if (lowp_) be_.cast(a.h_act_lp.slice(0, R), a.h_act.slice(0, R));
  be_.grouped_linear_forward(y, a.h_act_lp, w.down, offsets);
}

void MoeLayer::experts_backward(const MoeWeights& w, MoeActivations& a, MoeScratch& s,
                                const std::vector<int64_t>& offsets, const Tensor& dy, const Tensor& dx) {
  const int64_t R = offsets.back();
  if (R == 0) return;
  be_.grouped_linear_backward(s.d_act, w.down_grad, dy, a.h_act_lp, w.down, offsets);
  be_.swiglu_backward(s.d_pre.slice(0, R), a.h_pre.slice(0, R), s.d_act.slice(0, R));
  be_.grouped_linear_backward(dx, w.gate_up_grad, s.d_pre, a.xe, w.gate_up, offsets);
}

void MoeLayer::reorder(void* dst, const void* src, const int32_t* order, int64_t rows, int64_t bytes_per_row) const {
  profile::Span span(be_.tracer(), "ep_reorder", profile::Category::Kernel, 0, kernels::moe_gather_bytes(rows, bytes_per_row));
  kernels::moe_gather_rows(dst, src, order, rows, bytes_per_row);
}

void MoeLayer::plan_exchange(MoeActivations& a) const {
  const int64_t E = cfg_.moe.experts, P = exchange_->size(), r = exchange_->rank(), El = E / P;
  std::vector<int64_t> mine(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) mine[static_cast<size_t>(e)] = a.offsets[static_cast<size_t>(e) + 1] - a.offsets[static_cast<size_t>(e)];
  a.counts_all.assign(static_cast<size_t>(P * E), 0);
  exchange_->gather_counts(mine, a.counts_all);
  auto count = [&](int64_t src, int64_t e_local) { return a.counts_all[static_cast<size_t>(src * E + r * El + e_local)]; };
  // Rank j's experts' rows are consecutive in expert order: they leave as one block.
  a.send_rows.assign(static_cast<size_t>(P), 0), a.recv_rows.assign(static_cast<size_t>(P), 0);
  for (int64_t j = 0; j < P; ++j)
    a.send_rows[static_cast<size_t>(j)] = a.offsets[static_cast<size_t>((j + 1) * El)] - a.offsets[static_cast<size_t>(j * El)];
  for (int64_t i = 0; i < P; ++i)
    for (int64_t e = 0; e < El; ++e) a.recv_rows[static_cast<size_t>(i)] += count(i, e);
  // Received: source after source, each by expert. Run: expert after expert, each by source.
  a.local_offsets.assign(static_cast<size_t>(El) + 1, 0);
  for (int64_t e = 0; e < El; ++e) {
    int64_t n = 0;
    for (int64_t i = 0; i < P; ++i) n += count(i, e);
    a.local_offsets[static_cast<size_t>(e) + 1] = a.local_offsets[static_cast<size_t>(e)] + n;
  }
  const int64_t R = a.local_offsets.back();
  a.perm.assign(static_cast<size_t>(R), 0), a.inv.assign(static_cast<size_t>(R), 0);
  std::vector<int64_t> next(a.local_offsets.begin(), a.local_offsets.end() - 1);
  int64_t p = 0;
  for (int64_t i = 0; i < P; ++i)
    for (int64_t e = 0; e < El; ++e)
      for (int64_t n = count(i, e); n > 0; --n, ++p) {
        const int64_t q = next[static_cast<size_t>(e)]++;
        a.perm[static_cast<size_t>(q)] = static_cast<int32_t>(p);
        a.inv[static_cast<size_t>(p)] = static_cast<int32_t>(q);
      }
}

void MoeLayer::forward(const MoeWeights& w, MoeActivations& a, const Tensor& x_mine, const Tensor& x_f32_mine,
                       const Tensor& out, MoeLoad* load, MoeScratch* s) {
  const auto& m = cfg_.moe;
  const bool split_width = tp() > 1;
  if (split_width && !s) throw Error("internal: tensor parallelism needs the context's MoE scratch in forward");
  const auto [x, x_f32] = whole_inputs(x_mine, x_f32_mine, s);
  const int64_t N = x.dim(0), C = cfg_.d_model, E = m.experts, k = m.top_k;
  // Under tensor parallelism each rank's experts give a part of every output row: summed at the end.
  const Tensor sum = split_width ? s->partial.slice(0, N) : out;
  if (split_width) sum.fill_zero();
  const Tensor scores = a.scores.slice(0, N);
  be_.linear_forward(scores, w.router.w.dtype() == DType::F32 ? x_f32 : x, w.router.w, nullptr, false);
  // The selection bias in f32 (under bf16-pure the weights are bf16).
  std::vector<float> bias;
  if (w.score_bias.defined()) {
    bias.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      bias[static_cast<size_t>(e)] = w.score_bias.dtype() == DType::F32 ? w.score_bias.data<float>()[e]
                                                                         : bf16_to_f32(w.score_bias.data<bf16>()[e]);
  }
  {
    profile::Span span(be_.tracer(), "moe_route", profile::Category::Kernel, 0, kernels::moe_route_bytes(N, E, k));
    kernels::moe_route_forward(scores.data<float>(), a.expert.data<int32_t>(), a.weight.data<float>(), bias.empty() ? nullptr : bias.data(), N, E, k,
                               m.score, m.normalize_top_k);
    // Capacity: each expert's fair share of the pairs times the factor.
    const int64_t capacity = capacity_ ? m.capacity(N) : N * k;
    auto placed = kernels::moe_assign_rows(a.row.data<int32_t>(), a.token_of_row.data<int32_t>(),
                                           a.expert.data<int32_t>(), N, E, k, capacity);
    a.routed = std::move(placed.routed), a.offsets = std::move(placed.offsets);
    if (load) {
      load->routed.resize(static_cast<size_t>(E), 0);
      for (int64_t e = 0; e < E; ++e) load->routed[static_cast<size_t>(e)] += a.routed[static_cast<size_t>(e)];
      load->dropped += placed.dropped, load->pairs += N * k, ++load->micro_batches;
      load->aux_loss += kernels::moe_aux_loss(scores.data<float>(), a.routed, N, E, k, m.score);
    }
  }
  const int64_t M = a.offsets.back();
  {
    const int64_t row_bytes = C * static_cast<int64_t>(dtype_size(x.dtype()));
    profile::Span span(be_.tracer(), "moe_dispatch", profile::Category::Kernel, 0, kernels::moe_gather_bytes(M, row_bytes));
    kernels::moe_gather_rows(a.x.raw(), x.raw(), a.token_of_row.data<int32_t>(), M, row_bytes);
  }
  if (ep() == 1) {
    run_experts(w, a, a.offsets, a.y);
  } else {
    // Rows go to their expert's rank, run there expert by expert, and come back in the order they left.
    if (!s) throw Error("internal: expert parallelism needs the context's MoE scratch in forward");
    plan_exchange(a);
    const int64_t R = a.local_offsets.back();
    if (R > a.xe.dim(0))
      throw Error("internal: " + std::to_string(R) + " rows reached this rank's experts, past the " +
                  std::to_string(a.xe.dim(0)) + " its buffers hold (capacity off under expert parallelism?)");
    const int64_t row_bytes = C * static_cast<int64_t>(dtype_size(a.x.dtype()));
    exchange_->exchange_rows(a.x.raw(), a.send_rows, s->recv_lp.raw(), a.recv_rows, row_bytes, "ep_dispatch");
    reorder(a.xe.raw(), s->recv_lp.raw(), a.perm.data(), R, row_bytes);
    run_experts(w, a, a.local_offsets, s->by_expert);
    reorder(s->recv.raw(), s->by_expert.raw(), a.inv.data(), R, C * 4);
    exchange_->exchange_rows(s->recv.raw(), a.recv_rows, a.y.raw(), a.send_rows, C * 4, "ep_combine");
  }
  {
    profile::Span span(be_.tracer(), "moe_combine", profile::Category::Kernel, 0, kernels::moe_combine_bytes(N, M, C, k));
    kernels::moe_combine_forward(sum.data<float>(), a.y.data<float>(), a.row.data<int32_t>(), a.weight.data<float>(), N,
                                 k, C);
  }
  if (w.shared_gate_up.w.defined()) {
    const Tensor pre = a.shared_pre.slice(0, N), act = a.shared_act.slice(0, N), act_lp = a.shared_act_lp.slice(0, N);
    be_.linear_forward(pre, x, w.shared_gate_up.w, nullptr, false);
    be_.swiglu_forward(act, pre);
    if (lowp_) be_.cast(act_lp, act);
    be_.linear_forward(sum, act_lp, w.shared_down.w, nullptr, true);
  }
  if (split_width) ops_->add_group_sum(out, sum);
}

void MoeLayer::backward(const MoeWeights& w, MoeActivations& a, MoeScratch& s, const Tensor& dout_mine,
                        const Tensor& dx_mine, const Tensor& x_mine, const Tensor& x_f32_mine, double aux_scale) {
  const auto& m = cfg_.moe;
  const bool split_width = tp() > 1;
  // Under sequence parallelism the inputs are gathered again (not kept from forward: that would undo
  // sequence parallelism's saving), and the output gradient with them.
  const auto [x, x_f32] = whole_inputs(x_mine, x_f32_mine, &s);
  const Tensor dout = split().sequence_parallel
                          ? ops_->whole_rows(dout_mine, s.dout_whole.slice(0, dout_mine.dim(0) * tp()))
                          : dout_mine;
  const int64_t N = dout.dim(0), C = cfg_.d_model, E = m.experts, k = m.top_k;
  // Each rank's slice of the experts gives a part of the input gradient: summed over the group at the end.
  const Tensor dx = split_width ? s.partial.slice(0, N) : dx_mine;
  if (w.shared_gate_up.w.defined()) {
    const Tensor d_act = s.shared_d_act.slice(0, N), d_pre = s.shared_d_pre.slice(0, N);
    be_.linear_backward(&d_act, false, w.shared_down.dw, nullptr, dout, a.shared_act_lp.slice(0, N), w.shared_down.w);
    be_.swiglu_backward(d_pre, a.shared_pre.slice(0, N), d_act);
    be_.linear_backward(&dx, false, w.shared_gate_up.dw, nullptr, d_pre, x, w.shared_gate_up.w);
  } else {
    dx.fill_zero();
  }
  {
    profile::Span span(be_.tracer(), "moe_combine_backward", profile::Category::Kernel, 0,
                       kernels::moe_combine_backward_bytes(N, a.offsets.back(), C, k));
    kernels::moe_combine_backward(s.dy.data<float>(), s.dweight.data<float>(), dout.data<float>(), a.y.data<float>(),
                                  a.row.data<int32_t>(), a.weight.data<float>(), N, k, C);
  }
  // The combine weights' gradient <dout, y> of this rank's partial y: summed, every rank routes alike.
  if (split_width) ops_->sum_over_group(s.dweight.slice(0, N));
  if (ep() == 1) {
    experts_backward(w, a, s, a.offsets, s.dy, s.dx);
  } else {
    // The output gradients travel as the rows did; the input gradients come back.
    const int64_t R = a.local_offsets.back();
    exchange_->exchange_rows(s.dy.raw(), a.send_rows, s.recv.raw(), a.recv_rows, C * 4, "ep_dispatch_grad");
    reorder(s.by_expert.raw(), s.recv.raw(), a.perm.data(), R, C * 4);
    experts_backward(w, a, s, a.local_offsets, s.by_expert, s.recv);  // dx by expert into recv
    reorder(s.by_expert.raw(), s.recv.raw(), a.inv.data(), R, C * 4);
    exchange_->exchange_rows(s.by_expert.raw(), a.recv_rows, s.dx.raw(), a.send_rows, C * 4, "ep_combine_grad");
  }
  {
    profile::Span span(be_.tracer(), "moe_route_backward", profile::Category::Kernel, 0,
                       kernels::moe_route_backward_bytes(N, a.offsets.back(), C, E, k));
    kernels::moe_scatter_add_rows(dx.data<float>(), s.dx.data<float>(), a.row.data<int32_t>(), N, k, C);
    kernels::moe_route_backward(s.dlogits.data<float>(), s.dweight.data<float>(), a.scores.data<float>(),
                                a.expert.data<int32_t>(), a.weight.data<float>(), a.routed, aux_scale, N, E, k, m.score,
                                m.normalize_top_k);
  }
  const Tensor dlogits = s.dlogits.slice(0, N);
  // The router is whole on every rank and its gradient the same everywhere; its input gradient joins
  // the group's sum once (rank 0's part).
  const bool router_dx = !split_width || ops_->rank() == 0;
  be_.linear_backward(router_dx ? &dx : nullptr, true, w.router.dw, nullptr, dlogits,
                      w.router.w.dtype() == DType::F32 ? x_f32 : x, w.router.w);
  if (split_width) {
    dx_mine.fill_zero();
    ops_->add_group_sum(dx_mine, dx);
  }
}

}  // namespace loom::model
