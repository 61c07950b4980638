// The collective algorithms, each family in its own file, all written against Transport only:
//   one_shot.cpp  every rank's data through one exchange(); latency-bound small messages
//   direct.cpp    ranks read peers' registered buffers in place (reduce-scatter + all-gather by owner)
//   ring.cpp      bandwidth-optimal rings and pipelines over send_recv; any transport
// Element layouts: all_gather_v / all_to_all_v blocks are consecutive, in rank order, sized by counts.
// Every reduction has a fixed operand order, so all ranks end with bitwise-identical results.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "loom/comm/collective.h"
#include "loom/comm/transport.h"

namespace loom::comm {

// How one collective call is described to an algorithm. Pointers may alias where the op allows it
// (all_reduce in == out; all_gather in == out + displacement of this rank).
struct CollArgs {
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;  // all_reduce / broadcast / reduce: elements; reduce_scatter: output elements
  DType dtype = DType::F32;
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::span<const size_t> counts;       // all_gather_v: per-rank input counts; all_to_all_v: send counts
  std::span<const size_t> recv_counts;  // all_to_all_v: elements received from each rank
};

// Balanced split of `count` elements into `parts` chunks: chunk j is [chunk_begin(j), chunk_begin(j+1)).
inline size_t chunk_begin(size_t count, int parts, int j) { return count * static_cast<size_t>(j) / parts; }
std::vector<size_t> prefix_offsets(std::span<const size_t> counts);  // size n+1

// Bytes of the exchange record a one-shot algorithm would need; 0 if the op has no one-shot form.
size_t one_shot_record_bytes(OpKind kind, const CollArgs& a, int size);

void all_reduce_one_shot(Transport& t, const CollArgs& a);
void reduce_scatter_one_shot(Transport& t, const CollArgs& a);
void all_gather_v_one_shot(Transport& t, const CollArgs& a);
void broadcast_one_shot(Transport& t, const CollArgs& a);
void reduce_one_shot(Transport& t, const CollArgs& a);
void all_to_all_v_one_shot(Transport& t, const CollArgs& a);

// Direct algorithms return false (having done nothing) when unregistered inputs do not fit in the
// arena for staging; the caller then runs the ring form.
bool all_reduce_direct(Transport& t, const CollArgs& a);
bool reduce_scatter_direct(Transport& t, const CollArgs& a);
bool all_gather_v_direct(Transport& t, const CollArgs& a);
bool broadcast_direct(Transport& t, const CollArgs& a);
bool reduce_direct(Transport& t, const CollArgs& a);
bool all_to_all_v_direct(Transport& t, const CollArgs& a);

void all_reduce_ring(Transport& t, const CollArgs& a);
void reduce_scatter_ring(Transport& t, const CollArgs& a);
void all_gather_v_ring(Transport& t, const CollArgs& a);
void broadcast_chain(Transport& t, const CollArgs& a);
void reduce_ring(Transport& t, const CollArgs& a);
void all_to_all_v_pairwise(Transport& t, const CollArgs& a);

}  // namespace loom::comm
