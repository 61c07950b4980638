// Alpha-beta cost of collectives, in nccl-tests' language: a collective over n ranks of S bytes takes
//   steps(n, topology) * alpha + S * busbw_factor(op, n) / (link bandwidth * link efficiency)
// with busbw_factor = 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter / all_gather / all_to_all
// (S the total size across ranks), 1 for broadcast / reduce / send. `loom bench comm` reports busbw with
// the same factors, so a measured busbw plugs straight into `Link::bandwidth * efficiency`.
// On one machine's shared memory (`Topology::SharedMemory`) the steps are those of Loom's own library
// (comm/dispatch.h: one-shot for small messages, direct above), which `loom calibrate` measures.
#pragma once

#include <cstdint>

#include "loom/plan/hardware.h"

namespace loom::plan {

enum class Collective { AllReduce, ReduceScatter, AllGather, AllToAll, Broadcast, SendRecv };

// Bus-bandwidth factor of nccl-tests for `op` over n ranks.
double busbw_factor(Collective op, int n);
// Latency hops of the algorithm used on `topology`: a ring takes n-1 steps per phase, a 2-D torus
// about 2(sqrt(n)-1), a switch (tree / NVLS) about log2(n), shared memory one (Loom's one-shot and
// direct algorithms: all_reduce = reduce-scatter + all-gather by owner, two phases).
double latency_steps(Collective op, int n, Topology topology);

// Time of one collective of `bytes` (total across ranks for RS/AG/A2A; per rank for AR/broadcast/send)
// over n ranks on one link kind.
double collective_time(Collective op, double bytes, int n, const Link& link, double link_efficiency);

// A group of n ranks laid out over nodes: `per_node` of them share a node (intra link), the group
// spans n / per_node nodes (inter link). Hierarchical all_reduce = reduce_scatter inside the node,
// all_reduce of 1/per_node of the data across nodes (all per_node rails in parallel), all_gather inside.
struct GroupShape {
  int n = 1;
  int per_node = 1;  // ranks of the group that share a node
};
// `staged`: on buffers the transport stages (Hardware::staged_intra_node inside a node).
double group_collective_time(Collective op, double bytes, GroupShape g, const Hardware& hw, bool staged = false);

}  // namespace loom::plan
