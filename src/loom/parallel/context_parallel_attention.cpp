#include "loom/parallel/context_parallel_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "loom/error.h"

namespace loom::parallel {

namespace {

// Tags of the ring's messages: K/V blocks and the dK/dV accumulators travel side by side in backward;
// a group's messages arrive in the order they were sent, and the tag checks that they line up.
constexpr uint64_t kKvTag = 0xC9'0001, kDkvTag = 0xC9'0002;

// rows x width floats from src (row stride src_row) into dst (row stride dst_row).
void copy_rows(float* dst, int64_t dst_row, const float* src, int64_t src_row, int64_t rows, int64_t width) {
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(dst + t * dst_row, src + t * src_row, static_cast<size_t>(width) * sizeof(float));
}

// dst rows += src rows (rows x width floats; row strides dst_row, src_row).
void add_rows(float* dst, int64_t dst_row, const float* src, int64_t src_row, int64_t rows, int64_t width) {
  for (int64_t t = 0; t < rows; ++t) {
    float* d = dst + t * dst_row;
    const float* s = src + t * src_row;
    for (int64_t k = 0; k < width; ++k) d[k] += s[k];
  }
}

// Merges a block's (o_b, lse_b) into the running (o, lse) of the same queries: the online softmax's
// step across blocks. o rows [B, rows] of H D floats at row stride o_row (offset o_first rows into each
// sample of `total` rows), lse [B, H, total] likewise; o_b [B, rows, H D], lse_b [B, H, rows] dense.
void merge_block(float* o, float* lse, const float* o_b, const float* lse_b, int64_t B, int64_t H, int64_t D,
                 int64_t total, int64_t first, int64_t rows) {
  const int64_t HD = H * D;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < rows; ++t) {
        float& l = lse[(b * H + h) * total + first + t];
        const float lb = lse_b[(b * H + h) * rows + t];
        const float m = std::max(l, lb);
        if (m == -std::numeric_limits<float>::infinity()) continue;  // neither block saw a key
        const float merged = m + std::log(std::exp(l - m) + std::exp(lb - m));
        const float w = std::exp(l - merged), wb = std::exp(lb - merged);
        float* dst = o + (b * total + first + t) * HD + h * D;
        const float* src = o_b + (b * rows + t) * HD + h * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = w * dst[d] + wb * src[d];
        l = merged;
      }
}

// Between a rank's rows of whole segments (row-major, widths summing to W) and block p of an all-to-all
// buffer (rows of width W / size: rank p's part of every segment). `pack` picks the direction.
void copy_parts(float* block, float* rows, int64_t n_rows, const std::vector<int64_t>& widths, int size, int p,
                bool pack) {
  int64_t W = 0;
  for (int64_t w : widths) W += w;
  const int64_t Wp = W / size;
  for (int64_t r = 0; r < n_rows; ++r) {
    int64_t whole = 0, part_at = 0;
    for (int64_t w : widths) {
      const int64_t part = w / size;
      float* a = block + r * Wp + part_at;
      float* b = rows + r * W + whole + p * part;
      std::memcpy(pack ? a : b, pack ? b : a, static_cast<size_t>(part) * sizeof(float));
      whole += w, part_at += part;
    }
  }
}

// Between the whole sequence's rows (B x T * size, at their global positions) and block q of an
// all-to-all buffer (rank q's T rows of every sample). `pack` picks the direction.
void copy_rank_rows(float* block, float* seq, int64_t B, int64_t T, int64_t width, int size,
                    const std::vector<int>& positions, bool pack) {
  const int64_t Tg = T * size;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* a = block + (b * T + t) * width;
      float* s = seq + (b * Tg + positions[static_cast<size_t>(t)]) * width;
      std::memcpy(pack ? a : s, pack ? s : a, static_cast<size_t>(width) * sizeof(float));
    }
}

}  // namespace

ContextParallelAttention::ContextParallelAttention(kernels::Backend& backend, comm::ProcessGroup& cp, spec::CpMode mode)
    : kernels::AttentionOps(backend), cp_(cp), rank_(cp.rank()), size_(cp.size()), mode_(mode), in_flight_(backend) {}

Tensor ContextParallelAttention::scratch(Slot slot, const Shape& shape) {
  Tensor& t = scratch_[slot];
  if (!t.defined() || t.numel() < shape.numel())
    t = Tensor::empty({shape.numel()}, DType::F32, be_.allocator(), MemCategory::Activations);
  return Tensor::wrap(t.raw(), shape, DType::F32);
}

void ContextParallelAttention::reserve(const kernels::AttentionShape& s) {
  // Every slot at its largest use, from the first call: the peak is the same on every rank and every
  // step (the planner's engine memory counts exactly these).
  const int64_t B = s.B, Tl = s.T, c = Tl / 2, HD = s.H * s.D, KD2 = 2 * s.KVH * s.D;
  auto at_least = [&](Slot slot, int64_t n) { scratch(slot, {n}); };
  if (mode_ == spec::CpMode::Ring) {
    for (Slot slot : {kKv0, kKv1, kAcc0, kAcc1, kDkv}) at_least(slot, B * Tl * KD2);
    at_least(kKvHead, B * c * KD2);
    for (Slot slot : {kQ, kBlock, kDq}) at_least(slot, B * Tl * HD);
    at_least(kQTail, B * c * HD);
    at_least(kLseBlock, B * s.H * Tl);
    at_least(kTail, 2 * B * c * HD);
    return;
  }
  at_least(kSend, B * Tl * std::max(HD + KD2, 2 * HD));
  at_least(kRecv, B * Tl * std::max(HD + KD2, 2 * HD));
  for (Slot slot : {kOut, kQ}) at_least(slot, B * Tl * HD);
  at_least(kDq, 2 * B * Tl * HD);
  at_least(kDkv, B * Tl * (HD + KD2));
}

const std::vector<std::vector<int32_t>>& ContextParallelAttention::positions(int64_t T) {
  if (positions_T_ != T) {
    positions_.clear();
    for (int r = 0; r < size_; ++r) positions_.push_back(spec::context_positions(T * size_, size_, r));
    positions_T_ = T;
  }
  return positions_;
}

InFlight::Pending ContextParallelAttention::ring_shift(const Tensor& send, const Tensor& recv, uint64_t tag,
                                                       const char* name, const char* wait_name) {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const size_t n = static_cast<size_t>(send.numel());
  const comm::ProcessGroup::PeerOp ops[2] = {{true, send.raw(), n, DType::F32, next, tag},
                                             {false, recv.raw(), n, DType::F32, prev, tag}};
  return in_flight_.issue(cp_.send_recv_many(ops), name, wait_name, static_cast<double>(send.nbytes()));
}

void ContextParallelAttention::forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                       const kernels::AttentionShape& s) {
  reserve(s);
  if (mode_ == spec::CpMode::Ring) return ring_forward(out, lse, qkv, s);
  const int64_t HD = s.H * s.D, KD = s.KVH * s.D;
  to_heads(qkv, qkv, s.B, s.T, {HD, KD, KD}, "cp_all_to_all_qkv", "cp_all_to_all_qkv.wait");
  recompute(out, lse, qkv, s);
}

void ContextParallelAttention::recompute(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                         const kernels::AttentionShape& s) {
  reserve(s);
  if (mode_ == spec::CpMode::Ring) return ring_forward(out, lse, qkv, s);
  // qkv is head-sharded already (forward left it so); lse stays in that layout for backward.
  kernels::AttentionShape h = s;
  h.T = s.T * size_, h.H = s.H / size_, h.KVH = s.KVH / size_;
  const Tensor out_h = scratch(kOut, {s.B, h.T, h.H * s.D});
  be_.attention_forward(out_h, lse, qkv, h);
  to_sequence(out, out_h, s.B, s.T, {s.H * s.D}, "cp_all_to_all_out", "cp_all_to_all_out.wait");
}

void ContextParallelAttention::backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                                        const Tensor& qkv, const kernels::AttentionShape& s) {
  reserve(s);
  if (mode_ == spec::CpMode::Ring) return ring_backward(dqkv, dout, out, lse, qkv, s);
  const int64_t B = s.B, T = s.T, HD = s.H * s.D, KD = s.KVH * s.D;
  kernels::AttentionShape h = s;
  h.T = T * size_, h.H = s.H / size_, h.KVH = s.KVH / size_;
  // dO and O go over together: one all-to-all of [dO | O] rows.
  const Tensor both = scratch(kDq, {B, T, 2 * HD});
  float* b2 = both.data<float>();
  copy_rows(b2, 2 * HD, dout.data<float>(), HD, B * T, HD);
  copy_rows(b2 + HD, 2 * HD, out.data<float>(), HD, B * T, HD);
  to_heads(both, both, B, T, {HD, HD}, "cp_all_to_all_dout", "cp_all_to_all_dout.wait");
  const int64_t hd = h.H * s.D;
  const Tensor dout_h = scratch(kQ, {B, h.T, hd}), out_h = scratch(kOut, {B, h.T, hd});
  copy_rows(dout_h.data<float>(), hd, both.data<float>(), 2 * hd, B * h.T, hd);
  copy_rows(out_h.data<float>(), hd, both.data<float>() + hd, 2 * hd, B * h.T, hd);
  const Tensor dqkv_h = scratch(kDkv, {B, h.T, (h.H + 2 * h.KVH) * s.D});
  be_.attention_backward(dqkv_h, dout_h, out_h, lse, qkv, h);
  to_sequence(dqkv, dqkv_h, B, T, {HD, KD, KD}, "cp_all_to_all_dqkv", "cp_all_to_all_dqkv.wait");
}

// --- ring ------------------------------------------------------------------------------------------

// Rank r holds chunks r (local rows [0, c)) and 2n-1-r (rows [c, 2c)). K/V of rank j reach it at step
// (r - j) mod n. j < r: both of r's chunks follow chunk j and precede chunk 2n-1-j, so all 2c queries
// attend to the first c keys. j > r: only the tail chunk follows either of j's chunks, and it follows
// both, so c queries attend to all 2c keys. Either way one c x 2c block, no mask.
void ContextParallelAttention::ring_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                            const kernels::AttentionShape& s) {
  const int64_t B = s.B, Tl = s.T, c = Tl / 2, HD = s.H * s.D, KD2 = 2 * s.KVH * s.D, W = HD + KD2;
  const float* x = qkv.data<float>();
  Tensor kv[2] = {scratch(kKv0, {B, Tl, KD2}), scratch(kKv1, {B, Tl, KD2})};
  copy_rows(kv[0].data<float>(), KD2, x + HD, W, B * Tl, KD2);
  InFlight::Pending pending;
  if (size_ > 1) pending = ring_shift(kv[0], kv[1], kKvTag, "cp_ring_kv", "cp_ring_kv.wait");
  be_.attention_forward(out, lse, qkv, s);  // step 0: this rank's own tokens, causal

  const Tensor q = scratch(kQ, {B, Tl, HD}), q_tail = scratch(kQTail, {B, c, HD});
  copy_rows(q.data<float>(), HD, x, W, B * Tl, HD);
  for (int64_t b = 0; b < B; ++b)
    copy_rows(q_tail.data<float>() + b * c * HD, HD, x + (b * Tl + c) * W, W, c, HD);
  for (int i = 1; i < size_; ++i) {
    in_flight_.wait(pending);
    const Tensor& here = kv[i % 2];
    if (i + 1 < size_) pending = ring_shift(here, kv[(i + 1) % 2], kKvTag, "cp_ring_kv", "cp_ring_kv.wait");
    const int j = (rank_ - i + size_) % size_;
    if (j < rank_) {
      const Tensor head = scratch(kKvHead, {B, c, KD2});
      for (int64_t b = 0; b < B; ++b)
        copy_rows(head.data<float>() + b * c * KD2, KD2, here.data<float>() + b * Tl * KD2, KD2, c, KD2);
      const Tensor o = scratch(kBlock, {B, Tl, HD}), l = scratch(kLseBlock, {B, s.H, Tl});
      be_.attention_block_forward(o, l, q, head, s);
      merge_block(out.data<float>(), lse.data<float>(), o.data<float>(), l.data<float>(), B, s.H, s.D, Tl, 0, Tl);
    } else {
      kernels::AttentionShape st = s;
      st.T = c;
      const Tensor o = scratch(kBlock, {B, c, HD}), l = scratch(kLseBlock, {B, s.H, c});
      be_.attention_block_forward(o, l, q_tail, here, st);
      merge_block(out.data<float>(), lse.data<float>(), o.data<float>(), l.data<float>(), B, s.H, s.D, Tl, c, c);
    }
  }
}

void ContextParallelAttention::prepare_backward(const Tensor& qkv, const kernels::AttentionShape& s) {
  if (mode_ != spec::CpMode::Ring || size_ == 1) return;
  reserve(s);
  const int64_t B = s.B, Tl = s.T, HD = s.H * s.D, KD2 = 2 * s.KVH * s.D;
  const Tensor kv0 = scratch(kKv0, {B, Tl, KD2}), kv1 = scratch(kKv1, {B, Tl, KD2});
  copy_rows(kv0.data<float>(), KD2, qkv.data<float>() + HD, HD + KD2, B * Tl, KD2);
  first_hop_ = ring_shift(kv0, kv1, kKvTag, "cp_ring_kv", "cp_ring_kv.wait");
  first_hop_of_ = qkv.raw();
}

// The other ranks' blocks first, then this rank's own causal block: the K/V's first hop left during the
// MLP's backward (prepare_backward), each later hop and each dK/dV hop hides under the next block, and
// the dK/dV accumulator's last hop home under the own block's backward.
void ContextParallelAttention::ring_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out,
                                             const Tensor& lse, const Tensor& qkv, const kernels::AttentionShape& s) {
  if (size_ == 1) return be_.attention_backward(dqkv, dout, out, lse, qkv, s);
  const int64_t B = s.B, Tl = s.T, c = Tl / 2, H = s.H, HD = H * s.D, KD2 = 2 * s.KVH * s.D, W = HD + KD2;
  const float* x = qkv.data<float>();
  Tensor kv[2] = {scratch(kKv0, {B, Tl, KD2}), scratch(kKv1, {B, Tl, KD2})};
  InFlight::Pending kv_pending, acc_pending;
  if (first_hop_of_ == qkv.raw()) {
    kv_pending = std::move(first_hop_);
  } else {  // a caller that did not prepare: the first hop starts here
    copy_rows(kv[0].data<float>(), KD2, x + HD, W, B * Tl, KD2);
    kv_pending = ring_shift(kv[0], kv[1], kKvTag, "cp_ring_kv", "cp_ring_kv.wait");
  }
  first_hop_of_ = nullptr;

  // The queries' side, dense: all rows, and the tail chunk's rows.
  const Tensor q = scratch(kQ, {B, Tl, HD}), q_tail = scratch(kQTail, {B, c, HD});
  const Tensor tail = scratch(kTail, {2, B, c, HD}), lse_tail = scratch(kLseBlock, {B, H, c});
  copy_rows(q.data<float>(), HD, x, W, B * Tl, HD);
  const float* lse_all = lse.data<float>();
  float* t3 = tail.data<float>();
  const int64_t tail_n = B * c * HD;
  for (int64_t b = 0; b < B; ++b) {
    copy_rows(q_tail.data<float>() + b * c * HD, HD, x + (b * Tl + c) * W, W, c, HD);
    copy_rows(t3 + b * c * HD, HD, dout.data<float>() + (b * Tl + c) * HD, HD, c, HD);
    copy_rows(t3 + tail_n + b * c * HD, HD, out.data<float>() + (b * Tl + c) * HD, HD, c, HD);
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(lse_tail.data<float>() + (b * H + h) * c, lse_all + (b * H + h) * Tl + c,
                  static_cast<size_t>(c) * sizeof(float));
  }
  const Tensor dout_tail = Tensor::wrap(t3, {B, c, HD}, DType::F32);
  const Tensor out_tail = Tensor::wrap(t3 + tail_n, {B, c, HD}, DType::F32);

  // dQ of the other ranks' blocks sums here (the own block's backward writes dqkv last).
  const Tensor dq_sum = scratch(kDq, {B, Tl, HD});
  dq_sum.fill_zero();
  // dK/dV of the K/V block at hand accumulate in a buffer that travels the ring one step behind it and
  // reaches the block's owner after the last step.
  Tensor acc[2] = {scratch(kAcc0, {B, Tl, KD2}), scratch(kAcc1, {B, Tl, KD2})};
  int acc_at = 0;  // which acc holds the running sum when the previous step's shift has landed
  for (int i = 1; i < size_; ++i) {
    in_flight_.wait(kv_pending);
    const Tensor& here = kv[i % 2];
    if (i + 1 < size_) kv_pending = ring_shift(here, kv[(i + 1) % 2], kKvTag, "cp_ring_kv", "cp_ring_kv.wait");
    const int j = (rank_ - i + size_) % size_;
    const bool head_keys = j < rank_;  // all queries x the first c keys, else the tail queries x all keys
    const int64_t qrows = head_keys ? Tl : c, krows = head_keys ? c : Tl;
    kernels::AttentionShape sb = s;
    sb.T = qrows;
    const Tensor dq = scratch(kBlock, {B, qrows, HD}), dkv = scratch(kDkv, {B, krows, KD2});
    if (head_keys) {
      const Tensor keys = scratch(kKvHead, {B, c, KD2});
      for (int64_t b = 0; b < B; ++b)
        copy_rows(keys.data<float>() + b * c * KD2, KD2, here.data<float>() + b * Tl * KD2, KD2, c, KD2);
      be_.attention_block_backward(dq, dkv, dout, out, lse, q, keys, sb);
    } else {
      be_.attention_block_backward(dq, dkv, dout_tail, out_tail, lse_tail, q_tail, here, sb);
    }
    for (int64_t b = 0; b < B; ++b)
      add_rows(dq_sum.data<float>() + (b * Tl + (head_keys ? 0 : c)) * HD, HD, dq.data<float>() + b * qrows * HD, HD,
               qrows, HD);
    // The running sum: this rank's share alone at step 1, else what arrived from the previous rank.
    if (i == 1) {
      acc[acc_at].fill_zero();
    } else {
      in_flight_.wait(acc_pending);
    }
    for (int64_t b = 0; b < B; ++b)
      add_rows(acc[acc_at].data<float>() + b * Tl * KD2, KD2, dkv.data<float>() + b * krows * KD2, KD2, krows, KD2);
    acc_pending = ring_shift(acc[acc_at], acc[1 - acc_at], kDkvTag, "cp_ring_dkv", "cp_ring_dkv.wait");
    acc_at = 1 - acc_at;
  }
  // This rank's own tokens, causal (P the true softmax restricted to its own keys), while the last
  // accumulator comes home.
  be_.attention_backward(dqkv, dout, out, lse, qkv, s);
  float* dx = dqkv.data<float>();
  add_rows(dx, W, dq_sum.data<float>(), HD, B * Tl, HD);
  // What arrives last is the sum of every other rank's share of this rank's own K/V.
  in_flight_.wait(acc_pending);
  add_rows(dx + HD, W, acc[acc_at].data<float>(), KD2, B * Tl, KD2);
}

// --- all-to-all ------------------------------------------------------------------------------------

void ContextParallelAttention::to_heads(const Tensor& dst, const Tensor& src, int64_t B, int64_t T,
                                        const std::vector<int64_t>& widths, const char* name, const char* wait_name) {
  int64_t W = 0;
  for (int64_t w : widths) W += w;
  const int64_t Wp = W / size_, block = B * T * Wp;
  // Block p of the send buffer: this rank's rows, rank p's part of every segment.
  const Tensor send = scratch(kSend, {size_ * block}), recv = scratch(kRecv, {size_ * block});
  for (int p = 0; p < size_; ++p)
    copy_parts(send.data<float>() + p * block, src.data<float>(), B * T, widths, size_, p, true);
  InFlight::Pending pending = in_flight_.issue(cp_.all_to_all(send.raw(), recv.raw(), static_cast<size_t>(block),
                                               DType::F32), name, wait_name, static_cast<double>(send.nbytes()));
  in_flight_.wait(pending);
  // Block q of what arrived: rank q's rows (at its positions), this rank's part.
  const auto& pos = positions(T);
  for (int q = 0; q < size_; ++q)
    copy_rank_rows(recv.data<float>() + q * block, dst.data<float>(), B, T, Wp, size_, pos[static_cast<size_t>(q)],
                   false);
}

void ContextParallelAttention::to_sequence(const Tensor& dst, const Tensor& src, int64_t B, int64_t T,
                                           const std::vector<int64_t>& widths, const char* name, const char* wait_name) {
  int64_t W = 0;
  for (int64_t w : widths) W += w;
  const int64_t Wp = W / size_, block = B * T * Wp;
  const Tensor send = scratch(kSend, {size_ * block}), recv = scratch(kRecv, {size_ * block});
  // Block q of the send buffer: rank q's rows of every sample, this rank's part.
  const auto& pos = positions(T);
  for (int q = 0; q < size_; ++q)
    copy_rank_rows(send.data<float>() + q * block, src.data<float>(), B, T, Wp, size_,
                   pos[static_cast<size_t>(q)], true);
  InFlight::Pending pending = in_flight_.issue(cp_.all_to_all(send.raw(), recv.raw(), static_cast<size_t>(block),
                                               DType::F32), name, wait_name, static_cast<double>(send.nbytes()));
  in_flight_.wait(pending);
  // Block p: this rank's rows, rank p's part of every segment.
  for (int p = 0; p < size_; ++p)
    copy_parts(recv.data<float>() + p * block, dst.data<float>(), B * T, widths, size_, p, false);
}

}  // namespace loom::parallel
