// Context parallelism's attention, as a kernels::AttentionOps: each rank of the cp group holds T / cp
// tokens of every sample (head and tail chunks, spec::context_positions), and attention crosses the
// group one of two ways (design in docs/parallel.md):
//   ring:       each rank's K/V go around the group by asynchronous send/recv while the block at hand
//               is computed; blocks merge through their log-sum-exp (the online softmax across ranks).
//               With head-and-tail chunks, step 0 is the causal attention of a rank's own tokens and
//               every later step one unmasked half-size block, so ranks do equal work. Backward sends
//               the K/V around again, and with them each block's dK/dV accumulating toward its owner.
//   all-to-all: (Ulysses) one all-to-all turns the sequence-sharded qkv into head-sharded qkv of the
//               whole sequence, attention runs on H / cp heads locally, and one all-to-all turns its
//               output back; backward mirrors it. Needs cp to divide the query and KV heads.
#pragma once

#include <array>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/kernels/attention_ops.h"
#include "loom/parallel/in_flight.h"
#include "loom/spec/context_parallel.h"

namespace loom::parallel {

class ContextParallelAttention final : public kernels::AttentionOps {
 public:
  ContextParallelAttention(kernels::Backend& backend, comm::ProcessGroup& cp, spec::CpMode mode);

  int size() const override { return size_; }
  int rank() const override { return rank_; }
  spec::CpMode mode() const { return mode_; }
  void forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const kernels::AttentionShape& s) override;
  void recompute(const Tensor& out, const Tensor& lse, const Tensor& qkv, const kernels::AttentionShape& s) override;
  // Ring: sends this rank's K/V on their first hop, hidden under the block's MLP backward.
  void prepare_backward(const Tensor& qkv, const kernels::AttentionShape& s) override;
  void backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                const kernels::AttentionShape& s) override;

  // Wall seconds this thread waited on the cp group (exposed), and seconds its transfers were in flight.
  double wait_seconds() const { return in_flight_.wait_seconds(); }
  double in_flight_seconds() const { return in_flight_.in_flight_seconds(); }

 private:
  // kBlock holds one K/V block's output in the ring's forward and its dQ in backward (never both live).
  enum Slot {
    kKv0, kKv1, kKvHead, kQ, kQTail, kOut, kBlock, kLseBlock, kDq, kDkv, kAcc0, kAcc1, kTail, kSend, kRecv, kSlots
  };
  Tensor scratch(Slot slot, const Shape& shape);
  void reserve(const kernels::AttentionShape& s);  // every slot the mode uses, at its largest

  void ring_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const kernels::AttentionShape& s);
  void ring_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                     const kernels::AttentionShape& s);
  // Sends `send` to the next rank and receives the previous rank's into `recv` (same size), in flight.
  InFlight::Pending ring_shift(const Tensor& send, const Tensor& recv, uint64_t tag, const char* name,
                               const char* wait_name);

  // All-to-all mode. `widths`: the column segments of a row (q, k, v heads: each split over the group).
  // to_heads: src [B, T_local, W] of this rank's tokens -> dst [B, T_local x cp, W / cp] of every token
  // in position order, this rank's part of each segment (dst may alias src). to_sequence: the inverse.
  void to_heads(const Tensor& dst, const Tensor& src, int64_t B, int64_t T, const std::vector<int64_t>& widths,
                const char* name, const char* wait_name);
  void to_sequence(const Tensor& dst, const Tensor& src, int64_t B, int64_t T, const std::vector<int64_t>& widths,
                   const char* name, const char* wait_name);
  const std::vector<std::vector<int32_t>>& positions(int64_t T);  // of every rank, T local tokens each

  comm::ProcessGroup& cp_;
  int rank_, size_;
  spec::CpMode mode_;
  std::array<Tensor, kSlots> scratch_;
  InFlight in_flight_;
  // The ring's first backward hop of K/V, sent by prepare_backward for the qkv it was given.
  InFlight::Pending first_hop_;
  const void* first_hop_of_ = nullptr;
  int64_t positions_T_ = -1;
  std::vector<std::vector<int32_t>> positions_;
};

}  // namespace loom::parallel
