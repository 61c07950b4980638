#include "loom/parallel/mesh_layout.h"

#include <fmt/format.h>

#include "loom/error.h"

namespace loom::parallel {

using spec::MeshAxis;

int MeshShape::size(MeshAxis axis) const {
  switch (axis) {
    case MeshAxis::PP: return pp;
    case MeshAxis::DP: return dp;
    case MeshAxis::CP: return cp;
    case MeshAxis::TP: return tp;
    case MeshAxis::EP: return 1;  // expert parallelism is drawn from dp x cp (a later issue)
  }
  return 1;
}

std::string MeshShape::str() const { return fmt::format("pp={} dp={} cp={} tp={}", pp, dp, cp, tp); }

int& MeshCoord::at(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::PP: return pp;
    case MeshAxis::DP: return dp;
    case MeshAxis::CP: return cp;
    case MeshAxis::TP: return tp;
    case MeshAxis::EP: break;
  }
  throw ConfigError("the ep axis is drawn from dp x cp and has no mesh coordinate of its own");
}

MeshCoord coord_of(const MeshShape& s, int rank) {
  MeshCoord c;
  c.tp = rank % s.tp;
  rank /= s.tp;
  c.cp = rank % s.cp;
  rank /= s.cp;
  c.dp = rank % s.dp;
  c.pp = rank / s.dp;
  return c;
}

int rank_of(const MeshShape& s, const MeshCoord& c) { return ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tp + c.tp; }

std::vector<std::vector<int>> axis_groups(const MeshShape& s, MeshAxis axis) {
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < s.world(); ++r) {
    MeshCoord c = coord_of(s, r);
    if (c.along(axis) != 0) continue;  // r leads its group
    std::vector<int> g;
    for (int i = 0; i < s.size(axis); ++i) {
      MeshCoord m = c;
      m.at(axis) = i;
      g.push_back(rank_of(s, m));
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

void validate_mesh(const MeshShape& s, int world_size) {
  if (s.pp < 1 || s.dp < 1 || s.cp < 1 || s.tp < 1)
    throw ConfigError(fmt::format("parallel degrees must be at least 1 (got {})", s.str()));
  if (s.world() != world_size)
    throw ConfigError(fmt::format(
        "parallel layout {} needs {} ranks but the job has {}: set parallel.dp (and tp, pp, cp) so their product is "
        "the number of ranks, or start {} ranks (loom run -n {} -- loom train ...)",
        s.str(), s.world(), world_size, s.world(), s.world()));
}

}  // namespace loom::parallel
