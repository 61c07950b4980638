#include "loom/spec/shard_plan.h"

#include <algorithm>
#include <string>

#include "loom/error.h"

namespace loom::spec {

namespace {
std::vector<ArenaRange> units_from_bounds(const std::vector<int64_t>& bounds) {
  if (bounds.size() < 2 || bounds.front() != 0)
    throw Error("internal: ZeRO unit bounds must start at 0 and hold at least one unit");
  std::vector<ArenaRange> units;
  for (size_t i = 1; i < bounds.size(); ++i) {
    if (bounds[i] < bounds[i - 1]) throw Error("internal: ZeRO unit bounds are not ascending");
    units.push_back({bounds[i - 1], bounds[i]});
  }
  return units;
}
}  // namespace

ShardPlan::ShardPlan(std::vector<int64_t> bounds, int dp) : ShardPlan(units_from_bounds(bounds), dp) {}

ShardPlan::ShardPlan(std::vector<ArenaRange> units, int dp) : units_(std::move(units)), dp_(dp) {
  if (dp_ < 1) throw ConfigError("a ZeRO shard plan needs at least one data-parallel rank, got " + std::to_string(dp_));
  if (units_.empty()) throw Error("internal: a ZeRO shard plan needs at least one unit");
  for (size_t i = 0; i < units_.size(); ++i)
    if (units_[i].begin < 0 || units_[i].end < units_[i].begin || (i > 0 && units_[i].begin < units_[i - 1].end))
      throw Error("internal: ZeRO units must be ascending and apart");
}

ArenaRange ShardPlan::piece(size_t u, int rank) const {
  const int64_t c = chunk(u), b = units_[u].begin;
  ArenaRange r{b + c * rank, b + c * (rank + 1)};
  if (rank == dp_ - 1) r.end = units_[u].end;
  return r;
}

std::vector<size_t> ShardPlan::counts(size_t u) const {
  std::vector<size_t> c(static_cast<size_t>(dp_));
  for (int r = 0; r < dp_; ++r) c[static_cast<size_t>(r)] = static_cast<size_t>(piece(u, r).size());
  return c;
}

int64_t ShardPlan::local_offset(size_t u, int rank) const {
  int64_t off = 0;
  for (size_t k = 0; k < u; ++k) off += piece(k, rank).size();
  return off;
}

int64_t ShardPlan::local_size(int rank) const { return local_offset(units(), rank); }

std::vector<ArenaRange> ShardPlan::pieces(int rank) const {
  std::vector<ArenaRange> out;
  for (size_t u = 0; u < units(); ++u) out.push_back(piece(u, rank));
  return out;
}

int64_t ShardPlan::largest_unit() const {
  int64_t m = 0;
  for (size_t u = 0; u < units(); ++u) m = std::max(m, unit(u).size());
  return m;
}

ShardPlan zero_shard_plan(const ParamTable& table, int64_t n_layers, int dp) {
  for (const auto& p : table.params())
    if (!p.placement.on(MeshAxis::DP).is_flat())
      throw ConfigError("'" + p.name + "' is placed " + p.placement.str() +
                        ": a ZeRO shard plan needs every tensor Shard(flat) along dp");
  return ShardPlan(unit_bounds_from_blocks(table.block_starts(n_layers), table.total_numel()), dp);
}

ZeroPlans zero_shard_plans(const ParamTable& table, int64_t n_layers, int dp, int expert_dp) {
  const ShardPlan whole = zero_shard_plan(table, n_layers, dp);
  std::vector<ArenaRange> rest, experts;
  const auto& params = table.params();
  size_t k = 0;
  for (size_t u = 0; u < whole.units(); ++u) {
    const ArenaRange unit = whole.unit(u);
    // The unit's experts run from its first expert tensor to its end; nothing else may lie among them.
    int64_t first = unit.end;
    for (; k < params.size() && params[k].offset < unit.end; ++k) {
      const auto& p = params[k];
      if (p.expert)
        first = std::min(first, p.offset);
      else if (p.numel() > 0 && p.offset >= first)
        throw Error("internal: '" + p.name + "' lies among the routed experts; ZeRO needs them at the end of their block");
    }
    rest.push_back({unit.begin, first});
    experts.push_back({first, unit.end});
  }
  return {ShardPlan(std::move(rest), dp), ShardPlan(std::move(experts), expert_dp)};
}

std::vector<int64_t> unit_bounds_from_blocks(const std::vector<int64_t>& block_starts, int64_t total) {
  std::vector<int64_t> b{0};
  for (int64_t s : block_starts) b.push_back(std::clamp(s, b.back(), total));
  b.push_back(total);
  return b;
}

}  // namespace loom::spec
