#include "loom/plan/collective_cost.h"

#include <algorithm>
#include <cmath>

namespace loom::plan {

double busbw_factor(Collective op, int n) {
  if (n <= 1) return 0;
  const double f = static_cast<double>(n - 1) / n;
  switch (op) {
    case Collective::AllReduce: return 2 * f;
    case Collective::ReduceScatter:
    case Collective::AllGather:
    case Collective::AllToAll: return f;
    case Collective::Broadcast:
    case Collective::SendRecv: return 1;
  }
  return 1;
}

double latency_steps(Collective op, int n, Topology t) {
  if (n <= 1) return 0;
  const double phases = op == Collective::AllReduce ? 2 : 1;
  if (op == Collective::SendRecv) return 1;
  switch (t) {
    case Topology::Ring: return phases * (n - 1);
    case Topology::Torus: return phases * 2 * (std::ceil(std::sqrt(static_cast<double>(n))) - 1);
    case Topology::Switch: return phases * std::ceil(std::log2(static_cast<double>(n)));
    case Topology::SharedMemory: return phases;
  }
  return phases * (n - 1);
}

double collective_time(Collective op, double bytes, int n, const Link& link, double eff) {
  if (n <= 1 || bytes <= 0) return 0;
  return latency_steps(op, n, link.topology) * link.latency + bytes * busbw_factor(op, n) / (link.bandwidth * eff);
}

double group_collective_time(Collective op, double bytes, GroupShape g, const Hardware& hw, bool staged) {
  const Link& intra = hw.intra_link(staged);
  const double eff = hw.efficiency.link;
  const int inside = std::max(1, std::min(g.per_node, g.n));
  const int across = std::max(1, g.n / inside);
  if (across == 1) return collective_time(op, bytes, inside, intra, eff);
  if (inside == 1) return collective_time(op, bytes, across, hw.inter_node, eff);
  switch (op) {
    case Collective::AllReduce:
      // RS in node, AR of 1/inside across nodes on every rail at once, AG in node.
      return collective_time(Collective::ReduceScatter, bytes, inside, intra, eff) +
             collective_time(Collective::AllReduce, bytes / inside, across, hw.inter_node, eff) +
             collective_time(Collective::AllGather, bytes, inside, intra, eff);
    case Collective::ReduceScatter:
    case Collective::AllGather:
      return collective_time(op, bytes, inside, intra, eff) +
             collective_time(op, bytes / inside, across, hw.inter_node, eff);
    case Collective::AllToAll: {
      // The share that leaves the node (across-1)/across crosses the per-device network.
      const double out = bytes * (across - 1.0) / across / g.n;
      return collective_time(op, bytes / across, inside, intra, eff) +
             latency_steps(op, across, Topology::Switch) * hw.inter_node.latency + out / (hw.inter_node.bandwidth * eff);
    }
    case Collective::Broadcast:
    case Collective::SendRecv: return collective_time(op, bytes, 2, hw.inter_node, eff);
  }
  return 0;
}

}  // namespace loom::plan
