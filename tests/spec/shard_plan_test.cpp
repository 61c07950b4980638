// Which arena elements each data-parallel rank owns under ZeRO: the pure arithmetic behind the
// reduce-scatters, the gathers and the optimizer's pieces.
#include "loom/spec/shard_plan.h"

#include <gtest/gtest.h>

#include <random>

#include "loom/error.h"
#include "loom/spec/param_table.h"

namespace loom::spec {
namespace {

TEST(ShardPlan, PiecesTileEveryUnitAndTheRemainderGoesToTheLastRank) {
  std::mt19937 rng(20261203);  // seed logged by being fixed here
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> bounds{0};
    const int units = 1 + static_cast<int>(rng() % 6);
    for (int u = 0; u < units; ++u) bounds.push_back(bounds.back() + static_cast<int64_t>(rng() % 40));  // empty units too
    const int dp = 1 + static_cast<int>(rng() % 5);
    const ShardPlan plan(bounds, dp);
    ASSERT_EQ(plan.units(), static_cast<size_t>(units));
    std::vector<int> owner(static_cast<size_t>(bounds.back()), -1);
    for (size_t u = 0; u < plan.units(); ++u) {
      const ArenaRange unit = plan.unit(u);
      int64_t covered = 0;
      for (int r = 0; r < dp; ++r) {
        const ArenaRange p = plan.piece(u, r);
        EXPECT_EQ(p.begin, unit.begin + covered) << "pieces are in rank order, back to back";
        covered += p.size();
        if (r < dp - 1) {
          EXPECT_EQ(p.size(), unit.size() / dp);
        }
        for (int64_t i = p.begin; i < p.end; ++i) owner[static_cast<size_t>(i)] = r;
        EXPECT_EQ(plan.counts(u)[static_cast<size_t>(r)], static_cast<size_t>(p.size()));
      }
      EXPECT_EQ(covered, unit.size());
      EXPECT_EQ(plan.remainder(u).size(), unit.size() % dp);
      EXPECT_EQ(plan.remainder(u).end, unit.end);
    }
    for (int o : owner) EXPECT_GE(o, 0) << "every element has an owner";
    for (int r = 0; r < dp; ++r) {
      int64_t offset = 0;
      for (size_t u = 0; u < plan.units(); ++u) {
        EXPECT_EQ(plan.local_offset(u, r), offset);
        offset += plan.piece(u, r).size();
      }
      EXPECT_EQ(plan.local_size(r), offset);
      EXPECT_EQ(plan.pieces(r).size(), plan.units());
    }
  }
}

TEST(ShardPlan, UnitsFollowTheModelsBlocks) {
  TransformerConfig cfg = preset("tiny");
  const auto table = build_param_table(cfg);
  const auto starts = table.block_starts(cfg.n_layers);
  const auto bounds = unit_bounds_from_blocks(starts, table.total_numel());
  ASSERT_EQ(bounds.size(), static_cast<size_t>(cfg.n_layers) + 3);  // embeddings, L blocks, head
  const ShardPlan plan(bounds, 4);
  EXPECT_EQ(plan.unit(0), (ArenaRange{0, starts[0]}));
  for (int64_t l = 0; l < cfg.n_layers; ++l)
    EXPECT_EQ(plan.unit(static_cast<size_t>(l) + 1), (ArenaRange{starts[l], starts[l + 1]}));
  EXPECT_EQ(plan.unit(plan.units() - 1).end, table.total_numel());
  // Blocks are all alike: the largest unit is a block or the embeddings.
  EXPECT_EQ(plan.largest_unit(), std::max(plan.unit(0).size(), plan.unit(1).size()));
}

// ZeRO's plan comes from the placements: a table whose tensors are Shard(flat) along dp, at any tp shard.
TEST(ShardPlan, ZeroPlanDerivesFromFlatDpPlacements) {
  TransformerConfig cfg = preset("tiny-llama");
  for (int tp : {1, 2}) {
    auto table = build_param_table(cfg, TableShard{tp - 1, tp});
    EXPECT_THROW(zero_shard_plan(table, cfg.n_layers, 2), ConfigError) << "replicated along dp: not ZeRO";
    table.shard_flat_along(MeshAxis::DP);
    EXPECT_EQ(table.at("model.norm.weight").placement.str(), "dp:Shard(flat)");
    if (tp > 1) {
      EXPECT_EQ(table.at("model.layers.0.mlp.down_proj.weight").placement.str(), "dp:Shard(flat),tp:Shard(1)");
    }
    const auto plan = zero_shard_plan(table, cfg.n_layers, 2);
    const ShardPlan by_hand(unit_bounds_from_blocks(table.block_starts(cfg.n_layers), table.total_numel()), 2);
    ASSERT_EQ(plan.units(), by_hand.units());
    for (size_t u = 0; u < plan.units(); ++u) EXPECT_EQ(plan.piece(u, 1), by_hand.piece(u, 1));
  }
}

TEST(ShardPlan, RefusesNoRanksAndUnorderedBounds) {
  EXPECT_THROW(ShardPlan({0, 10}, 0), ConfigError);
  EXPECT_THROW(ShardPlan({0, 10, 5}, 2), Error);
  EXPECT_THROW(ShardPlan({3, 10}, 2), Error);
  EXPECT_THROW(ShardPlan(std::vector<ArenaRange>{{0, 10}, {5, 12}}, 2), Error) << "overlapping units";
  EXPECT_THROW(ShardPlan(std::vector<ArenaRange>{{4, 2}}, 2), Error) << "a unit ending before it begins";
}

// Units with gaps: the gaps belong to no rank, the units are split as before.
TEST(ShardPlan, UnitsMayLeaveGapsForAnotherPlan) {
  const ShardPlan plan(std::vector<ArenaRange>{{0, 10}, {14, 14}, {20, 27}}, 3);
  EXPECT_EQ(plan.piece(0, 1), (ArenaRange{3, 6}));
  EXPECT_EQ(plan.piece(0, 2), (ArenaRange{6, 10}));
  EXPECT_EQ(plan.piece(1, 0).size(), 0);
  EXPECT_EQ(plan.piece(2, 0), (ArenaRange{20, 22}));
  EXPECT_EQ(plan.piece(2, 2), (ArenaRange{24, 27}));
  EXPECT_EQ(plan.local_size(2), 4 + 0 + 3);
  EXPECT_EQ(plan.local_offset(2, 2), 4);
}

// Under expert parallelism ZeRO runs two plans over the same units: the routed experts (the end of every
// MoE block) over the ranks holding the same experts, everything else over the replicas. Together they
// cover every unit exactly, and the expert plan holds exactly the expert tensors.
TEST(ShardPlan, ExpertParallelPlansSplitEachUnitIntoItsExpertsAndTheRest) {
  TransformerConfig cfg = preset("tiny-moe");
  cfg.moe.shared_experts = 1, cfg.moe.every = 2, cfg.moe.bias_update_rate = 0.001;
  cfg.n_layers = 4;
  for (const int ep : {1, 2, 4}) {
    TableShard shard;
    shard.ep_rank = ep - 1, shard.ep_size = ep;
    auto table = build_param_table(cfg, shard);
    table.shard_flat_along(MeshAxis::DP);
    const auto whole = zero_shard_plan(table, cfg.n_layers, 4);
    const auto plans = zero_shard_plans(table, cfg.n_layers, 4, 4 / ep);
    ASSERT_EQ(plans.rest.units(), whole.units());
    ASSERT_EQ(plans.experts.units(), whole.units());
    EXPECT_EQ(plans.rest.dp(), 4);
    EXPECT_EQ(plans.experts.dp(), 4 / ep);
    for (size_t u = 0; u < whole.units(); ++u) {
      const ArenaRange rest = plans.rest.unit(u), ex = plans.experts.unit(u);
      EXPECT_EQ(rest.begin, whole.unit(u).begin);
      EXPECT_EQ(rest.end, ex.begin);
      EXPECT_EQ(ex.end, whole.unit(u).end);
      int64_t expert_elements = 0;
      for (const auto& p : table.params())
        if (p.expert && p.offset >= whole.unit(u).begin && p.offset < whole.unit(u).end) {
          expert_elements += p.numel();
          EXPECT_GE(p.offset, ex.begin) << p.name;
        } else if (!p.expert && p.offset >= whole.unit(u).begin && p.offset < whole.unit(u).end) {
          EXPECT_LE(p.offset + p.numel(), rest.end) << p.name;
        }
      EXPECT_EQ(ex.size(), expert_elements) << "unit " << u;
    }
    int64_t all_experts = 0;
    for (const auto& r : expert_ranges(table)) all_experts += r.size();
    int64_t planned = 0;
    for (size_t u = 0; u < plans.experts.units(); ++u) planned += plans.experts.unit(u).size();
    EXPECT_EQ(planned, all_experts);
    EXPECT_GT(planned, 0);
  }
}

// A pipeline stage's table holds some blocks: the ones it does not hold are empty units, so the blocks
// it holds stay units of their own instead of merging with what follows them.
TEST(ShardPlan, BlocksAnotherPipelineStageHoldsAreEmptyUnits) {
  TransformerConfig cfg = preset("tiny-llama");
  cfg.n_layers = 4;
  TableShard shard;
  shard.blocks = {{2, 4}}, shard.embeddings = false, shard.head = true;
  const auto table = build_param_table(cfg, shard);
  const auto starts = table.block_starts(cfg.n_layers);
  const ShardPlan plan(unit_bounds_from_blocks(starts, table.total_numel()), 2);
  EXPECT_EQ(plan.unit(0).end, plan.unit(3).begin) << "no embeddings (a tied one lies before the blocks)";
  EXPECT_EQ(plan.unit(1).size(), 0);
  EXPECT_EQ(plan.unit(2).size(), 0);
  EXPECT_EQ(plan.unit(3).begin, table.at("model.layers.2.input_layernorm.weight").offset);
  EXPECT_EQ(plan.unit(4).begin, table.at("model.layers.3.input_layernorm.weight").offset);
  EXPECT_EQ(plan.unit(5).begin, table.at("model.norm.weight").offset);
  EXPECT_EQ(plan.unit(5).end, table.total_numel());
}

}  // namespace
}  // namespace loom::spec
