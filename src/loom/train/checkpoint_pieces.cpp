#include "loom/train/checkpoint_pieces.h"

#include <algorithm>
#include <optional>

#include "loom/spec/shard_plan.h"

namespace loom::train {

int64_t runs_numel(const std::vector<PieceRun>& runs) {
  int64_t n = 0;
  for (const auto& r : runs) n += r.numel();
  return n;
}

namespace {

// Appends a run of `length` global elements from `global`, folding it into the last strided run when it
// continues that run's pattern (same length, same stride).
void append_run(std::vector<PieceRun>& runs, int64_t global, int64_t length) {
  if (!runs.empty()) {
    PieceRun& last = runs.back();
    const int64_t last_start = last.global + (last.count - 1) * last.stride;
    if (last.count == 1 && last_start + last.length == global) {  // contiguous: one longer block
      last.length += length;
      last.stride = last.length;
      return;
    }
    if (last.length == length && (last.count == 1 || global - last_start == last.stride) && global > last_start) {
      last.stride = global - last_start;
      ++last.count;
      return;
    }
  }
  runs.push_back({global, length, length, 1});
}

}  // namespace

std::vector<SavePiece> save_pieces(const spec::ParamTable& table, const std::vector<spec::ArenaRange>& owned) {
  std::vector<SavePiece> out;
  const auto& params = table.params();
  size_t pi = 0;
  for (const auto& r : owned) {
    while (pi < params.size() && params[pi].offset + params[pi].numel() <= r.begin) ++pi;
    for (size_t k = pi; k < params.size() && params[k].offset < r.end; ++k) {
      const auto& p = params[k];
      const int64_t a = std::max(r.begin, p.offset), b = std::min(r.end, p.offset + p.numel());
      if (a >= b) continue;
      // A piece is a contiguous stretch of the arena without padding: padding ends one and the next
      // begins after it.
      std::optional<SavePiece> cur;
      table.for_each_global_run(p, a - p.offset, b - p.offset, [&](int64_t local, int64_t global, int64_t n) {
        if (global < 0) {
          if (cur) out.push_back(std::move(*cur)), cur.reset();
          return;
        }
        if (!cur) cur = SavePiece{k, p.offset + local, p.offset + local, {}};
        append_run(cur->runs, global, n);
        cur->end += n;
      });
      if (cur) out.push_back(std::move(*cur));
    }
  }
  return out;
}

std::vector<spec::ArenaRange> saved_ranges(const spec::ParamTable& table, int64_t n_layers, int dp, int dp_rank,
                                           const std::vector<spec::ArenaRange>& optimizer_pieces, int ep) {
  std::vector<spec::ArenaRange> share = optimizer_pieces;
  if (share.empty()) {
    const spec::ShardPlan plan(spec::unit_bounds_from_blocks(table.block_starts(n_layers), table.total_numel()), dp);
    for (const auto& r : plan.pieces(dp_rank))
      if (r.size() > 0) share.push_back(r);
  }
  auto out = spec::intersect(spec::counted_ranges(table), share);
  // Under ZeRO every expert element has one owner already (sharded over the ranks holding the same
  // experts); without it the expert replicas hold them alike and the first ep group writes them.
  if (ep <= 1 || !optimizer_pieces.empty()) return out;
  const auto experts = spec::expert_ranges(table);
  out = spec::subtract(out, experts);
  if (dp_rank < ep) {
    const auto mine = spec::intersect(spec::counted_ranges(table), experts);
    out.insert(out.end(), mine.begin(), mine.end());
    std::sort(out.begin(), out.end(), [](const spec::ArenaRange& a, const spec::ArenaRange& b) { return a.begin < b.begin; });
  }
  return out;
}

void PieceIndex::add(const std::string& key, size_t entry, const std::vector<PieceRun>& runs) {
  auto& v = runs_[key];
  int64_t offset = 0;
  for (const auto& r : runs)
    for (int64_t i = 0; i < r.count; ++i, offset += r.length)
      if (r.length > 0) v.push_back({r.global + i * r.stride, r.length, {entry, offset}});
  sorted_ = false;
}

void PieceIndex::sort() const {
  if (sorted_) return;
  for (auto& [key, v] : runs_)
    std::sort(v.begin(), v.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
  sorted_ = true;
}

int64_t PieceIndex::find(const std::string& key, int64_t global, int64_t n,
                         const std::function<void(const Source&, int64_t)>& f) const {
  sort();
  auto it = runs_.find(key);
  if (it == runs_.end()) return global;
  const auto& v = it->second;
  // The last run starting at or before `global`.
  auto r = std::upper_bound(v.begin(), v.end(), global, [](int64_t g, const Run& run) { return g < run.global; });
  if (r != v.begin()) --r;
  const int64_t end = global + n;
  for (; global < end && r != v.end(); ++r) {
    if (r->global + r->length <= global) continue;
    if (r->global > global) return global;  // a gap
    const int64_t take = std::min(end, r->global + r->length) - global;
    f({r->source.entry, r->source.offset + (global - r->global)}, take);
    global += take;
  }
  return global;
}

int64_t PieceIndex::first_gap(const std::string& key, int64_t numel) const {
  return find(key, 0, numel, [](const Source&, int64_t) {});
}

}  // namespace loom::train
