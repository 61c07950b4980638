// How a parameter is laid out across a mesh axis: replicated, or split along one tensor dimension.
// This is the single description of sharding: TP layers, ZeRO/FSDP, gradient reduction, checkpoint
// resharding and the planner's memory model all read it.
#pragma once

#include <string>

namespace loom::spec {

enum class MeshAxis { PP, DP, CP, TP, EP };

struct Placement {
  enum class Kind { Replicate, Shard };
  Kind kind = Kind::Replicate;
  int dim = -1;               // tensor dimension split when kind == Shard
  MeshAxis axis = MeshAxis::TP;  // the mesh axis it is split over

  static Placement replicate() { return {}; }
  static Placement shard(int dim, MeshAxis axis) { return {Kind::Shard, dim, axis}; }
  bool is_replicated() const { return kind == Kind::Replicate; }
  bool operator==(const Placement&) const = default;
  std::string str() const;  // "Replicate" or "Shard(0)@tp"
};

}  // namespace loom::spec
