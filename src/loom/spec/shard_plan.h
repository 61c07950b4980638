// Which part of the parameter arena each data-parallel rank owns under ZeRO. The arena is cut into
// units (embeddings, one per transformer block, final norm + head: the granularity at which ZeRO-3
// gathers weights and ZeRO-2 reduces gradients during backward); each unit is split evenly across the
// dp ranks. Pure arithmetic, so every rank derives the same plan and tests can check it alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "loom/spec/param_table.h"  // ArenaRange

namespace loom::spec {

class ShardPlan {
 public:
  // bounds: unit boundaries in the arena, ascending, from 0 to the arena's size (n_units + 1 values).
  // Unit u = [bounds[u], bounds[u+1]); rank r owns [begin + r*chunk, begin + (r+1)*chunk) with
  // chunk = size / dp, and the last rank also the remainder (fewer than dp elements), so the equal part
  // is one reduce-scatter and the remainder one small all-reduce.
  ShardPlan(std::vector<int64_t> bounds, int dp);
  // Units given as ranges, ascending and apart, with gaps allowed: the parts of the arena some other
  // plan shards (expert parallelism: the routed experts over the expert replicas, the rest over dp).
  ShardPlan(std::vector<ArenaRange> units, int dp);

  size_t units() const { return units_.size(); }
  int dp() const { return dp_; }
  ArenaRange unit(size_t u) const { return units_[u]; }
  int64_t chunk(size_t u) const { return unit(u).size() / dp_; }
  // Elements after the dp equal chunks (owned by the last rank).
  ArenaRange remainder(size_t u) const { return {units_[u].begin + chunk(u) * dp_, units_[u].end}; }
  // The arena range rank r owns in unit u.
  ArenaRange piece(size_t u, int rank) const;
  // Elements of unit u each rank owns (for all_gather_v).
  std::vector<size_t> counts(size_t u) const;
  // A rank's pieces laid end to end form its local shard (optimizer moments): where unit u's piece starts.
  int64_t local_offset(size_t u, int rank) const;
  int64_t local_size(int rank) const;
  std::vector<ArenaRange> pieces(int rank) const;
  // The largest unit, in elements (what a rank holds gathered at once, twice with prefetch).
  int64_t largest_unit() const;

 private:
  std::vector<ArenaRange> units_;
  int dp_;
};

// ZeRO's plan, derived from the table's placements: every tensor must be Shard(flat) along dp
// (ParamTable::shard_flat_along), else ConfigError names the first that is not. Units as below.
ShardPlan zero_shard_plan(const ParamTable& table, int64_t n_layers, int dp);

// ZeRO's plans under expert parallelism, unit for unit the same units as zero_shard_plan's: the routed
// experts' weights (ParamSpec::expert; the end of every MoE block, where the table lays them) sharded
// over the `expert_dp` ranks holding the same experts, and everything else over the `dp` replicas. A
// unit without experts is empty in `experts`.
struct ZeroPlans {
  ShardPlan rest, experts;
};
ZeroPlans zero_shard_plans(const ParamTable& table, int64_t n_layers, int dp, int expert_dp);

// Units from the block boundaries of a parameter table (spec::ParamTable::block_starts for n_layers):
// [0, starts[0]) embeddings, [starts[l], starts[l+1]) block l, [starts[n_layers], total) final norm
// and head. A unit a model lacks is empty.
std::vector<int64_t> unit_bounds_from_blocks(const std::vector<int64_t>& block_starts, int64_t total);

}  // namespace loom::spec
