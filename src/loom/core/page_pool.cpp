#include "loom/core/page_pool.h"

#include <algorithm>

namespace loom {
PagePool::PagePool(PageReservation& pages, size_t capacity, PageReservation::Release overflow)
    : pages_(pages), capacity_(capacity / PageReservation::page_size() * PageReservation::page_size()), overflow_(overflow) {}

size_t PagePool::give(size_t offset, size_t bytes) {
  const auto [first, length] = PageReservation::whole_pages(offset, bytes);
  if (length == 0) return 0;
  const size_t keep = std::min(length, capacity_ - pooled_);
  // The pooled part is the range's start; pages past the capacity go back to the kernel.
  if (keep < length) pages_.release(first + keep, length - keep, overflow_);
  if (keep == 0) return 0;
  runs_.push_back({first, first + keep});
  pooled_ += keep;
  return keep;
}

size_t PagePool::take(size_t offset, size_t bytes) {
  const auto [first, length] = PageReservation::whole_pages(offset, bytes);
  const size_t last = first + length;
  if (length == 0 || runs_.empty()) return 0;
  const size_t before = pooled_;
  // Pooled pages already inside the range stay where they are (a unit given back and needed again).
  std::vector<Run> gaps{{first, last}}, rest;
  for (const Run& r : runs_) {
    const size_t b = std::max(r.begin, first), e = std::min(r.end, last);
    if (b >= e) {
      rest.push_back(r);
      continue;
    }
    if (r.begin < b) rest.push_back({r.begin, b});
    if (e < r.end) rest.push_back({e, r.end});
    pooled_ -= e - b;
    std::vector<Run> cut;
    for (const Run& g : gaps) {
      if (g.end <= b || e <= g.begin) {
        cut.push_back(g);
        continue;
      }
      if (g.begin < b) cut.push_back({g.begin, b});
      if (e < g.end) cut.push_back({e, g.end});
    }
    gaps = std::move(cut);
  }
  runs_ = std::move(rest);
  // Fill the remaining gaps from the most recently pooled pages.
  for (const Run& g : gaps) {
    size_t at = g.begin;
    while (at < g.end && !runs_.empty()) {
      Run& r = runs_.back();
      const size_t n = std::min(g.end - at, r.end - r.begin);
      const size_t moved = pages_.move_pages(r.end - n, at, n);
      if (moved < n) {  // the kernel refused part: give this run back, the gap faults in as before
        pages_.release(r.begin, r.end - r.begin, overflow_);
        pooled_ -= r.end - r.begin;
        runs_.pop_back();
        break;
      }
      r.end -= n;
      pooled_ -= n;
      at += n;
      if (r.begin == r.end) runs_.pop_back();
    }
  }
  return before - pooled_;
}

size_t PagePool::drain() {
  const size_t n = pooled_;
  for (const Run& r : runs_) pages_.release(r.begin, r.end - r.begin, overflow_);
  runs_.clear();
  pooled_ = 0;
  return n;
}

}  // namespace loom
