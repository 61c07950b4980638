#include "loom/comm/dispatch.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "loom/comm/reduce_kernels.h"

namespace loom::comm {

Algo run_collective(Transport& t, OpKind k, const CollArgs& a, const Tuning& tuning) {
  const Algo forced = tuning.forced[static_cast<int>(k)];
  // kAllToAllV has no one-shot form: ranks cannot agree on its record size without an extra exchange.
  const size_t record = k == OpKind::kAllToAllV ? SIZE_MAX : one_shot_record_bytes(k, a, t.size());
  const bool fits = record <= t.max_exchange_bytes();
  const bool small = record <= tuning.one_shot_max_bytes;
  if (fits && (forced == Algo::kOneShot || (forced == Algo::kAuto && small))) {
    switch (k) {
      case OpKind::kAllReduce: all_reduce_one_shot(t, a); break;
      case OpKind::kReduceScatter: reduce_scatter_one_shot(t, a); break;
      case OpKind::kAllGather:
      case OpKind::kAllGatherV: all_gather_v_one_shot(t, a); break;
      case OpKind::kBroadcast: broadcast_one_shot(t, a); break;
      case OpKind::kReduce: reduce_one_shot(t, a); break;
      case OpKind::kAllToAll: all_to_all_v_one_shot(t, a); break;
      default: break;
    }
    return Algo::kOneShot;
  }
  if ((forced == Algo::kDirect && t.reads_peers()) || (forced != Algo::kRing && t.maps_peers())) {
    bool done = false;
    switch (k) {
      case OpKind::kAllReduce: done = all_reduce_direct(t, a); break;
      case OpKind::kReduceScatter: done = reduce_scatter_direct(t, a); break;
      case OpKind::kAllGather:
      case OpKind::kAllGatherV: done = all_gather_v_direct(t, a); break;
      case OpKind::kBroadcast: done = broadcast_direct(t, a); break;
      case OpKind::kReduce: done = reduce_direct(t, a); break;
      case OpKind::kAllToAll:
      case OpKind::kAllToAllV: done = all_to_all_v_direct(t, a); break;
      default: break;
    }
    if (done) return Algo::kDirect;
  }
  switch (k) {
    case OpKind::kAllReduce: all_reduce_ring(t, a); break;
    case OpKind::kReduceScatter: reduce_scatter_ring(t, a); break;
    case OpKind::kAllGather:
    case OpKind::kAllGatherV: all_gather_v_ring(t, a); break;
    case OpKind::kBroadcast: broadcast_chain(t, a); break;
    case OpKind::kReduce: reduce_ring(t, a); break;
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV: all_to_all_v_pairwise(t, a); break;
    default: break;
  }
  return Algo::kRing;
}

namespace {
// Scales by 1/n after the sum stages: avg over all ranks, not an avg of node averages.
void finish_avg(void* buf, size_t count, const CollArgs& a, int n) {
  if (a.reduce == ReduceOp::kAvg) reduce_hop(buf, nullptr, buf, count, a.dtype, ReduceOp::kAvg, true, n);
}
CollArgs as_sum(CollArgs a) {
  if (a.reduce == ReduceOp::kAvg) a.reduce = ReduceOp::kSum;
  return a;
}
}  // namespace

// all_reduce: node all_reduce (shared memory), inter-node all_reduce of this local rank's chunk (each
// node's local rank l talks to the other nodes' local rank l), node all_gather of the chunks.
// reduce_scatter / all_gather: blocks are permuted to [local rank][node] so the node-local step
// moves contiguous ranges, then the inter-node step works on this local rank's share.
Algo run_hierarchical(OpKind kind, const CollArgs& a, Transport& local, Transport& cross, const Tuning& tuning) {
  const int L = local.size(), N = cross.size(), l = local.rank();
  const int n = L * N;
  const size_t es = dtype_size(a.dtype);
  if (kind == OpKind::kAllReduce) {
    CollArgs s = as_sum(a);
    run_collective(local, OpKind::kAllReduce, s, tuning);
    const size_t lo = chunk_begin(a.count, L, l), hi = chunk_begin(a.count, L, l + 1);
    auto* out = static_cast<std::byte*>(a.out);
    CollArgs c = s;
    c.in = c.out = out + lo * es;
    c.count = hi - lo;
    run_collective(cross, OpKind::kAllReduce, c, tuning);
    finish_avg(out + lo * es, hi - lo, a, n);
    std::vector<size_t> counts(L);
    for (int j = 0; j < L; ++j) counts[j] = chunk_begin(a.count, L, j + 1) - chunk_begin(a.count, L, j);
    CollArgs g{.in = out + lo * es, .out = out, .count = a.count, .dtype = a.dtype, .counts = counts};
    run_collective(local, OpKind::kAllGatherV, g, tuning);
    return Algo::kAuto;
  }
  const size_t block = a.count * es;
  if (kind == OpKind::kReduceScatter) {
    // in: n blocks by global rank g = node*L + l'. Reorder to [l'][node] so local rank l' receives
    // the N blocks it owns across nodes, contiguous.
    std::vector<std::byte> permuted(n * block), mine(N * block);
    const auto* in = static_cast<const std::byte*>(a.in);
    for (int node = 0; node < N; ++node)
      for (int j = 0; j < L; ++j)
        if (block) std::memcpy(permuted.data() + (j * N + node) * block, in + (node * L + j) * block, block);
    CollArgs s = as_sum(a);
    CollArgs r1 = s;
    r1.in = permuted.data();
    r1.out = mine.data();
    r1.count = a.count * N;
    run_collective(local, OpKind::kReduceScatter, r1, tuning);
    CollArgs r2 = s;
    r2.in = mine.data();
    run_collective(cross, OpKind::kReduceScatter, r2, tuning);
    finish_avg(a.out, a.count, a, n);
    return Algo::kAuto;
  }
  // all_gather: across nodes first (this local rank's peers), then inside the node, then un-permute.
  std::vector<std::byte> across(N * block), gathered(n * block);
  std::vector<size_t> cross_counts(N, a.count), local_counts(L, a.count * N);
  CollArgs g1{.in = a.in, .out = across.data(), .count = a.count, .dtype = a.dtype, .counts = cross_counts};
  run_collective(cross, OpKind::kAllGather, g1, tuning);
  CollArgs g2{.in = across.data(), .out = gathered.data(), .count = a.count * N, .dtype = a.dtype, .counts = local_counts};
  run_collective(local, OpKind::kAllGather, g2, tuning);
  auto* out = static_cast<std::byte*>(a.out);
  for (int node = 0; node < N; ++node)
    for (int j = 0; j < L; ++j)
      if (block) std::memcpy(out + (node * L + j) * block, gathered.data() + (j * N + node) * block, block);
  return Algo::kAuto;
}

}  // namespace loom::comm
