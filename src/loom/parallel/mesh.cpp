#include "loom/parallel/mesh.h"

#include <algorithm>

namespace loom::parallel {

using spec::MeshAxis;

namespace {
constexpr MeshAxis kAxes[4] = {MeshAxis::PP, MeshAxis::DP, MeshAxis::CP, MeshAxis::TP};
}

Mesh::Mesh(const MeshShape& shape, comm::World& world) : shape_(shape), world_(world), rank_(world.rank()) {
  validate_mesh(shape_, world.size());
  coord_ = coord_of(shape_, rank_);
  for (int a = 0; a < 4; ++a) {
    const int size = shape_.size(kAxes[a]);
    if (size == 1) continue;
    if (size == world.size()) {  // the axis is the whole job: no second group over the same ranks
      groups_[a] = &world.group();
      continue;
    }
    // Collective: every rank splits, in the same axis order. Colour = the group's first rank, key =
    // the position along the axis, so group rank i is coordinate i.
    const auto groups = axis_groups(shape_, kAxes[a]);
    int color = -1;
    for (const auto& g : groups)
      if (std::find(g.begin(), g.end(), rank_) != g.end()) color = g.front();
    owned_[a] = world.group().split(color, coord_.along(kAxes[a]));
    groups_[a] = owned_[a].get();
  }
  // The replicas: dp alone or cp alone reuse that axis' group; both split once more (collective).
  const int replicas = shape_.dp * shape_.cp;
  if (shape_.cp == 1) {
    replicas_ = group(MeshAxis::DP);
  } else if (shape_.dp == 1) {
    replicas_ = group(MeshAxis::CP);
  } else if (replicas == world.size()) {
    replicas_ = &world.group();
  } else {
    MeshCoord first = coord_;
    first.dp = first.cp = 0;
    owned_replicas_ = world.group().split(rank_of(shape_, first), coord_.dp * shape_.cp + coord_.cp);
    replicas_ = owned_replicas_.get();
  }
}

Mesh::~Mesh() = default;

comm::ProcessGroup* Mesh::group(MeshAxis axis) const {
  for (int a = 0; a < 4; ++a)
    if (kAxes[a] == axis) return groups_[a];
  return nullptr;
}

}  // namespace loom::parallel
