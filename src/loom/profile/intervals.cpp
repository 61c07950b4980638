#include "loom/profile/intervals.h"

#include <algorithm>

namespace loom::profile {

std::vector<Interval> union_of(std::vector<Interval> v) {
  std::erase_if(v, [](const Interval& i) { return !(i.end > i.begin); });
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.begin <= out.back().end)
      out.back().end = std::max(out.back().end, i.end);
    else
      out.push_back(i);
  }
  return out;
}

double length(const std::vector<Interval>& u) {
  double n = 0;
  for (const Interval& i : u) n += i.end - i.begin;
  return n;
}

std::vector<Interval> intersect(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].begin, b[j].begin), hi = std::min(a[i].end, b[j].end);
    if (hi > lo) out.push_back({lo, hi});
    if (a[i].end < b[j].end)
      ++i;
    else
      ++j;
  }
  return out;
}

std::vector<Interval> subtract(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  size_t j = 0;
  for (Interval i : a) {
    while (j < b.size() && b[j].end <= i.begin) ++j;
    for (size_t k = j; k < b.size() && b[k].begin < i.end; ++k) {
      if (b[k].begin > i.begin) out.push_back({i.begin, b[k].begin});
      i.begin = std::max(i.begin, b[k].end);
    }
    if (i.end > i.begin) out.push_back(i);
  }
  return out;
}

std::vector<Interval> clip(const std::vector<Interval>& a, Interval w) { return intersect(a, {w}); }

}  // namespace loom::profile
