// One-shot algorithms: each rank puts its whole contribution into its exchange record, the exchange
// doubles as the barrier, and each rank computes its result from the records (in rank order). One
// synchronisation in all: the fastest form while the data fits a record (ShmOptions::exchange_bytes).
#include <algorithm>
#include <cstring>
#include <numeric>

#include "loom/comm/algorithms.h"
#include "loom/comm/reduce_kernels.h"
#include "loom/error.h"

namespace loom::comm {

namespace {
std::span<const std::byte> bytes_of(const void* p, size_t n) { return {static_cast<const std::byte*>(p), n}; }
}  // namespace

std::vector<size_t> prefix_offsets(std::span<const size_t> counts) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

size_t one_shot_record_bytes(OpKind kind, const CollArgs& a, int size) {
  const size_t es = dtype_size(a.dtype);
  switch (kind) {
    case OpKind::kAllReduce:
    case OpKind::kReduce:
    case OpKind::kBroadcast: return a.count * es;
    case OpKind::kReduceScatter: return a.count * es * size;
    case OpKind::kAllGather:
    case OpKind::kAllGatherV: return *std::max_element(a.counts.begin(), a.counts.end()) * es;
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV:
      return std::accumulate(a.counts.begin(), a.counts.end(), size_t{0}) * es + sizeof(uint64_t) * (size + 1);
    default: return 0;
  }
}

void all_reduce_one_shot(Transport& t, const CollArgs& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  auto recs = t.exchange(bytes_of(a.in, bytes));
  std::vector<const void*> srcs(recs.size());
  for (size_t r = 0; r < recs.size(); ++r) srcs[r] = recs[r].data();
  reduce_sources(a.out, srcs, a.count, a.dtype, a.reduce, t.size());
}

void reduce_scatter_one_shot(Transport& t, const CollArgs& a) {
  const size_t es = dtype_size(a.dtype);
  auto recs = t.exchange(bytes_of(a.in, a.count * es * t.size()));
  std::vector<const void*> srcs(recs.size());
  for (size_t r = 0; r < recs.size(); ++r) srcs[r] = recs[r].data() + a.count * es * t.rank();
  reduce_sources(a.out, srcs, a.count, a.dtype, a.reduce, t.size());
}

void all_gather_v_one_shot(Transport& t, const CollArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const auto off = prefix_offsets(a.counts);
  auto recs = t.exchange(bytes_of(a.in, a.counts[t.rank()] * es));
  auto* out = static_cast<std::byte*>(a.out);
  for (int r = 0; r < t.size(); ++r) {
    if (recs[r].size() != a.counts[r] * es)
      throw CommError("all_gather_v: group rank " + std::to_string(r) + " sent " + std::to_string(recs[r].size()) +
                      " bytes, expected " + std::to_string(a.counts[r] * es) + " (ranks disagree on counts)");
    std::memmove(out + off[r] * es, recs[r].data(), recs[r].size());
  }
}

void broadcast_one_shot(Transport& t, const CollArgs& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  auto recs = t.exchange(t.rank() == a.root ? bytes_of(a.out, bytes) : std::span<const std::byte>{});
  if (t.rank() != a.root) std::memcpy(a.out, recs[a.root].data(), bytes);
}

void reduce_one_shot(Transport& t, const CollArgs& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  auto recs = t.exchange(bytes_of(a.in, bytes));
  if (t.rank() != a.root) return;
  std::vector<const void*> srcs(recs.size());
  for (size_t r = 0; r < recs.size(); ++r) srcs[r] = recs[r].data();
  reduce_sources(a.out, srcs, a.count, a.dtype, a.reduce, t.size());
}

// Record: n+1 send offsets (elements), then the send blocks.
void all_to_all_v_one_shot(Transport& t, const CollArgs& a) {
  const int n = t.size();
  const size_t es = dtype_size(a.dtype);
  const auto send_off = prefix_offsets(a.counts);
  const size_t head = sizeof(uint64_t) * (n + 1);
  std::vector<std::byte> rec(head + send_off[n] * es);
  for (int j = 0; j <= n; ++j) {
    uint64_t o = send_off[j];
    std::memcpy(rec.data() + sizeof(uint64_t) * j, &o, sizeof o);
  }
  if (send_off[n]) std::memcpy(rec.data() + head, a.in, send_off[n] * es);
  auto recs = t.exchange(rec);
  const auto recv_off = prefix_offsets(a.recv_counts);
  auto* out = static_cast<std::byte*>(a.out);
  for (int j = 0; j < n; ++j) {
    uint64_t o[2];
    std::memcpy(o, recs[j].data() + sizeof(uint64_t) * t.rank(), sizeof o);
    if (o[1] - o[0] != a.recv_counts[j])
      throw CommError("all_to_all_v: group rank " + std::to_string(j) + " sends " + std::to_string(o[1] - o[0]) +
                      " elements to group rank " + std::to_string(t.rank()) + ", which expects " +
                      std::to_string(a.recv_counts[j]) + " (send and receive counts disagree)");
    const size_t bytes = a.recv_counts[j] * es;
    if (bytes) std::memcpy(out + recv_off[j] * es, recs[j].data() + head + o[0] * es, bytes);
  }
}

}  // namespace loom::comm
