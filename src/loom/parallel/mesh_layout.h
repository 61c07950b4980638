// Which global ranks form each group of each mesh axis: a pure function of the axis sizes, so it is
// unit-tested without processes and every rank computes the same answer.
//
// Axes nest outermost to innermost as pp, dp, cp, tp: tp varies fastest, so a tp group is consecutive
// ranks and stays on one node (ranks are numbered node by node). Global rank
//   r = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i.
// Worked example, 16 ranks as pp=2 dp=2 cp=2 tp=2 (docs/parallel.md has the full table):
//   tp groups {0,1} {2,3} ... {14,15};  cp groups {0,2} {1,3} {4,6} ...;  dp groups {0,4} {1,5} {2,6} ...;
//   pp groups {0,8} {1,9} ... {7,15}.  Rank 13 = pp 1, dp 1, cp 0, tp 1.
#pragma once

#include <string>
#include <vector>

#include "loom/spec/placement.h"

namespace loom::parallel {

struct MeshShape {
  int pp = 1, dp = 1, cp = 1, tp = 1;
  int world() const { return pp * dp * cp * tp; }
  int size(spec::MeshAxis axis) const;
  std::string str() const;  // "pp=1 dp=4 cp=1 tp=1"
};

struct MeshCoord {
  int pp = 0, dp = 0, cp = 0, tp = 0;
  int along(spec::MeshAxis axis) const {
    MeshCoord c = *this;
    return c.at(axis);
  }
  int& at(spec::MeshAxis axis);  // EP has no coordinate of its own: throws
};

MeshCoord coord_of(const MeshShape& shape, int rank);
int rank_of(const MeshShape& shape, const MeshCoord& c);

// Every group of `axis`, each listing its global ranks in axis order; groups ordered by their first rank.
std::vector<std::vector<int>> axis_groups(const MeshShape& shape, spec::MeshAxis axis);

// Throws ConfigError naming the numbers: degrees < 1, or a product that is not the world size.
void validate_mesh(const MeshShape& shape, int world_size);

}  // namespace loom::parallel
