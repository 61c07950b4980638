// The device mesh of a job: one ProcessGroup per parallel axis, built once from parallel.{pp,dp,cp,tp}
// (see mesh_layout.h for which ranks form which group). Every later parallelism takes its groups here.
#pragma once

#include <memory>

#include "loom/comm/world.h"
#include "loom/parallel/mesh_layout.h"

namespace loom::parallel {

class Mesh {
 public:
  // Collective over the whole world: every rank must build the mesh with the same shape.
  Mesh(const MeshShape& shape, comm::World& world);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  int rank() const { return rank_; }
  // The group of `axis` this rank belongs to; nullptr when the axis has size 1.
  comm::ProcessGroup* group(spec::MeshAxis axis) const;
  // The ranks that hold the same weights (same pp and tp coordinates): dp x cp of them, ordered by
  // (dp, cp), so replica rank / cp is the dp coordinate. Gradients are reduced and ZeRO shards over it.
  // nullptr when dp x cp = 1.
  comm::ProcessGroup* replica_group() const { return replicas_; }
  comm::ProcessGroup& world_group() const { return world_.group(); }

 private:
  MeshShape shape_;
  comm::World& world_;
  int rank_;
  MeshCoord coord_;
  std::unique_ptr<comm::ProcessGroup> owned_[4];  // pp, dp, cp, tp (split off the world group)
  comm::ProcessGroup* groups_[4] = {};
  std::unique_ptr<comm::ProcessGroup> owned_replicas_;
  comm::ProcessGroup* replicas_ = nullptr;
};

}  // namespace loom::parallel
