#include "loom/spec/shard_plan.h"

#include <algorithm>
#include <string>

#include "loom/error.h"

namespace loom::spec {

ShardPlan::ShardPlan(std::vector<int64_t> bounds, int dp) : bounds_(std::move(bounds)), dp_(dp) {
  if (dp_ < 1) throw ConfigError("a ZeRO shard plan needs at least one data-parallel rank, got " + std::to_string(dp_));
  if (bounds_.size() < 2 || bounds_.front() != 0)
    throw Error("internal: ZeRO unit bounds must start at 0 and hold at least one unit");
  for (size_t i = 1; i < bounds_.size(); ++i)
    if (bounds_[i] < bounds_[i - 1]) throw Error("internal: ZeRO unit bounds are not ascending");
}

ArenaRange ShardPlan::piece(size_t u, int rank) const {
  const int64_t c = chunk(u), b = bounds_[u];
  ArenaRange r{b + c * rank, b + c * (rank + 1)};
  if (rank == dp_ - 1) r.end = bounds_[u + 1];
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

std::vector<int64_t> unit_bounds_from_blocks(const std::vector<int64_t>& block_starts, int64_t total) {
  std::vector<int64_t> b{0};
  for (int64_t s : block_starts) b.push_back(std::clamp(s, b.back(), total));
  b.push_back(total);
  return b;
}

}  // namespace loom::spec
