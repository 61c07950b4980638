// Time as sets of intervals: the union of spans (how long at least one ran), their overlap with another
// set, clipped to a window. Trace analysis measures compute, communication and their overlap with these
// (Holistic Trace Analysis' temporal and overlap breakdowns are defined the same way).
#pragma once

#include <vector>

namespace loom::profile {

struct Interval {
  double begin = 0, end = 0;
};

// Sorted, disjoint, non-empty intervals covering exactly what `v` covers.
std::vector<Interval> union_of(std::vector<Interval> v);
// Total length of a union.
double length(const std::vector<Interval>& u);
// The part of union `a` that union `b` also covers.
std::vector<Interval> intersect(const std::vector<Interval>& a, const std::vector<Interval>& b);
// The part of union `a` that union `b` does not cover.
std::vector<Interval> subtract(const std::vector<Interval>& a, const std::vector<Interval>& b);
// The part of union `a` inside [w.begin, w.end).
std::vector<Interval> clip(const std::vector<Interval>& a, Interval w);

}  // namespace loom::profile
