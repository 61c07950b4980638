// How a parameter is laid out across the device mesh, DTensor-style: for every mesh axis, replicated or
// sharded along one tensor dimension. This is the single description of sharding: TP layers, ZeRO/FSDP,
// gradient reduction, checkpoint resharding and the planner's memory model all read it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace loom::spec {

enum class MeshAxis { PP, DP, CP, TP, EP };
inline constexpr int kMeshAxes = 5;
const char* axis_name(MeshAxis a);  // "pp", "dp", ...

// What a tensor is along one mesh axis.
//   Shard(dim): the dimension is cut into `blocks` equal blocks (3 for GPT-2's fused q/k/v rows, so each
//   of q, k, v is split rather than the fused rows), each block is cut into `pieces` equal pieces (0: the
//   axis' size), and axis rank r holds piece r * pieces / size of every block, laid end to end. Fewer
//   pieces than ranks replicate each piece over size / pieces ranks (grouped-query KV heads at tp > kv).
//   A dimension that the pieces do not divide is padded to the next multiple (a vocabulary at any tp):
//   the padding has no global element.
//   Shard(flat) (dim -1): the tensor is part of a flattened unit of the arena (the embeddings, one block,
//   the final norm + head) that the axis cuts into equal pieces regardless of tensor boundaries: ZeRO's
//   and FSDP's flat parameters along dp. spec::ShardPlan says which piece of each unit a rank owns.
struct AxisPlacement {
  enum class Kind : uint8_t { Replicate, Shard };
  Kind kind = Kind::Replicate;
  int dim = -1;
  int blocks = 1;
  int pieces = 0;

  static AxisPlacement replicate() { return {}; }
  static AxisPlacement shard(int dim, int blocks = 1, int pieces = 0) { return {Kind::Shard, dim, blocks, pieces}; }
  static AxisPlacement flat() { return {Kind::Shard, -1, 1, 0}; }
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_flat() const { return kind == Kind::Shard && dim < 0; }
  bool operator==(const AxisPlacement&) const = default;
  std::string str() const;  // "Replicate", "Shard(0)", "Shard(0, 3 blocks)", "Shard(0, 2 pieces)", "Shard(flat)"
};

struct Placement {
  std::array<AxisPlacement, kMeshAxes> axes{};

  static Placement replicate() { return {}; }
  // This placement with `axis` set to `p`.
  Placement with(MeshAxis axis, AxisPlacement p) const {
    Placement q = *this;
    q.axes[static_cast<int>(axis)] = p;
    return q;
  }
  const AxisPlacement& on(MeshAxis axis) const { return axes[static_cast<int>(axis)]; }
  bool is_replicated() const;  // along every axis
  bool operator==(const Placement&) const = default;
  std::string str() const;  // "Replicate", or the sharded axes: "tp:Shard(0)", "dp:Shard(0),tp:Shard(1)"
};

}  // namespace loom::spec
