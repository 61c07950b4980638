// Which ranks form each mesh axis group: the pure function behind parallel::Mesh.
#include "loom/parallel/mesh_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "loom/error.h"

namespace loom::parallel {
namespace {

using spec::MeshAxis;
using Groups = std::vector<std::vector<int>>;

TEST(MeshLayout, WorkedSixteenRankExample) {
  const MeshShape s{.pp = 2, .dp = 2, .cp = 2, .tp = 2};
  EXPECT_EQ(axis_groups(s, MeshAxis::TP), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(axis_groups(s, MeshAxis::CP), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(axis_groups(s, MeshAxis::DP), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(axis_groups(s, MeshAxis::PP), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  const MeshCoord c = coord_of(s, 13);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.cp, 0);
  EXPECT_EQ(c.tp, 1);
}

TEST(MeshLayout, EveryAxisPartitionsTheWorldAndCoordinatesRoundTrip) {
  for (MeshShape s : {MeshShape{1, 4, 1, 1}, MeshShape{2, 3, 1, 2}, MeshShape{1, 2, 3, 4}, MeshShape{3, 1, 1, 1}}) {
    for (int r = 0; r < s.world(); ++r) EXPECT_EQ(rank_of(s, coord_of(s, r)), r) << s.str();
    for (MeshAxis axis : {MeshAxis::PP, MeshAxis::DP, MeshAxis::CP, MeshAxis::TP}) {
      std::multiset<int> seen;
      for (const auto& g : axis_groups(s, axis)) {
        EXPECT_EQ(static_cast<int>(g.size()), s.size(axis)) << s.str();
        for (size_t i = 0; i < g.size(); ++i) {
          EXPECT_EQ(coord_of(s, g[i]).along(axis), static_cast<int>(i));  // group rank i is coordinate i
          seen.insert(g[i]);
        }
      }
      EXPECT_EQ(static_cast<int>(seen.size()), s.world());
      EXPECT_EQ(std::set<int>(seen.begin(), seen.end()).size(), seen.size()) << "a rank in two groups of one axis";
    }
  }
}

TEST(MeshLayout, TensorParallelGroupsAreConsecutiveRanksSoTheyStayOnANode) {
  const MeshShape s{.pp = 1, .dp = 4, .cp = 1, .tp = 4};
  for (const auto& g : axis_groups(s, MeshAxis::TP))
    for (size_t i = 1; i < g.size(); ++i) EXPECT_EQ(g[i], g[0] + static_cast<int>(i));
}

TEST(MeshLayout, ALayoutThatDoesNotFitTheJobNamesTheNumbers) {
  try {
    validate_mesh(MeshShape{.dp = 3}, 4);
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("dp=3"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("needs 3 ranks but the job has 4"));
  }
  EXPECT_THROW(validate_mesh(MeshShape{.dp = 0}, 1), ConfigError);
  EXPECT_NO_THROW(validate_mesh(MeshShape{.dp = 2, .tp = 2}, 4));
}

}  // namespace
}  // namespace loom::parallel
