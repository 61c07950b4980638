#include "loom/profile/trace_analysis.h"

#include <algorithm>
#include <map>

#include "loom/error.h"
#include "loom/profile/intervals.h"

namespace loom::profile {

bool is_pipeline_wait(const std::string& name) { return name.rfind("pp_", 0) == 0; }

namespace {

bool is_compute(Category c) { return c == Category::Gemm || c == Category::Kernel; }

// The analysed step windows of one rank: its "step" spans after the first `skip` (the last one when
// there are no more).
std::vector<Interval> step_windows(const std::vector<const TraceSpan*>& spans, int skip) {
  std::vector<Interval> steps;
  for (const TraceSpan* s : spans)
    if (s->category == Category::Step && s->name == "step") steps.push_back({s->start_s, s->end_s()});
  std::sort(steps.begin(), steps.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  if (steps.empty()) return steps;
  const size_t first = std::min(static_cast<size_t>(std::max(skip, 0)), steps.size() - 1);
  return {steps.begin() + static_cast<std::ptrdiff_t>(first), steps.end()};
}

bool inside(const TraceSpan& s, const std::vector<Interval>& windows) {
  for (const Interval& w : windows)
    if (s.start_s >= w.begin && s.start_s < w.end) return true;
  return false;
}

}  // namespace

RankBreakdown TraceAnalysis::mean() const {
  RankBreakdown m;
  m.rank = -1;
  if (ranks.empty()) return m;
  for (const auto& r : ranks) {
    m.steps += r.steps;
    m.step += r.step, m.compute += r.compute, m.gemm += r.gemm, m.other += r.other;
    m.comm_exposed += r.comm_exposed, m.comm_sum += r.comm_sum, m.pipeline_wait += r.pipeline_wait;
    m.in_flight += r.in_flight, m.overlapped += r.overlapped, m.host += r.host, m.idle += r.idle;
    m.host_traced += r.host_traced;
    m.flops += r.flops, m.bytes += r.bytes;
  }
  const double n = static_cast<double>(ranks.size());
  m.steps = static_cast<int>(m.steps / static_cast<int>(ranks.size()));
  for (double* f : {&m.step, &m.compute, &m.gemm, &m.other, &m.comm_exposed, &m.comm_sum, &m.pipeline_wait,
                    &m.in_flight, &m.overlapped, &m.host, &m.host_traced, &m.idle, &m.flops, &m.bytes})
    *f /= n;
  return m;
}

TraceAnalysis analyse_trace(const std::vector<TraceSpan>& spans, int skip_steps) {
  std::map<int, std::vector<const TraceSpan*>> by_rank;
  for (const auto& s : spans) by_rank[s.rank].push_back(&s);
  TraceAnalysis out;
  std::map<std::string, KernelClass> kernels, wait_classes, host_classes;
  double rank_steps = 0;  // analysed steps summed over ranks
  // Per collective name, per rank: the durations of its waits in the analysed steps, in order (waits
  // that do not name their collective: traces of older builds).
  std::map<std::string, std::map<int, std::vector<double>>> waits;
  // Waits that name their collective (group, sequence number): per collective, each rank that ran it
  // (its progress thread's span) and how long that rank's training thread waited for it.
  struct Collective {
    std::string wait_name;
    std::map<int, double> waited;
  };
  std::map<std::pair<std::string, int64_t>, Collective> collectives;
  for (auto& [rank, list] : by_rank) {
    const auto windows = step_windows(list, skip_steps);
    if (windows.empty()) continue;
    std::vector<Interval> gemm, other, comm, pipe, flight, host, work;
    RankBreakdown r;
    r.rank = rank;
    r.steps = static_cast<int>(windows.size());
    for (const TraceSpan* s : list) {
      const Interval i{s->start_s, s->end_s()};
      if (s->category == Category::Gemm) gemm.push_back(i);
      if (s->category == Category::Kernel) other.push_back(i);
      if (s->category == Category::InFlight) flight.push_back(i);
      if (s->category == Category::Host) host.push_back(i);
      if (s->category == Category::CommWork) work.push_back(i);
      if (s->category == Category::Communication) (is_pipeline_wait(s->name) ? pipe : comm).push_back(i);
      if (!inside(*s, windows)) continue;
      if (is_compute(s->category)) {
        r.flops += s->flops, r.bytes += s->bytes;
        auto& k = kernels[s->name];
        k.name = s->name, k.category = s->category;
        k.calls += 1, k.seconds += s->duration_s, k.flops += s->flops, k.bytes += s->bytes;
      }
      if (s->category == Category::Host) {
        auto& k = host_classes[s->name];
        k.name = s->name, k.category = s->category;
        k.calls += 1, k.seconds += s->duration_s;
      }
      if (s->category == Category::Communication) {
        auto& k = wait_classes[s->name];
        k.name = s->name, k.category = s->category;
        k.calls += 1, k.seconds += s->duration_s, k.bytes += s->bytes;
      }
      if (s->category == Category::Communication && !is_pipeline_wait(s->name)) {
        r.comm_sum += s->duration_s;
        if (!s->group.empty() && s->seq >= 0) {
          auto& c = collectives[{s->group, s->seq}];
          c.wait_name = s->name;
          c.waited[rank] += s->duration_s;
        } else {
          waits[s->name][rank].push_back(s->duration_s);
        }
      }
      if (s->category == Category::CommWork && !s->group.empty() && s->seq >= 0)
        collectives[{s->group, s->seq}].waited.try_emplace(rank, 0.0);
    }
    const auto u_gemm = union_of(gemm), u_other = union_of(other), u_pipe = union_of(pipe), u_flight = union_of(flight),
               u_host = union_of(host);
    std::vector<Interval> all_compute = u_gemm;
    all_compute.insert(all_compute.end(), u_other.begin(), u_other.end());
    const auto u_compute = union_of(all_compute);
    // Collective work no compute ran beside (an op run inline on the training thread, or the progress
    // thread's while the training thread did nothing else) is exposed like a wait -- except while the
    // training thread waits on a pipeline transfer: that work is the transfer, counted as its wait.
    for (const Interval& i : subtract(subtract(union_of(work), u_compute), u_pipe)) comm.push_back(i);
    const auto u_comm = union_of(comm);
    std::vector<Interval> busy = u_compute;
    busy.insert(busy.end(), u_comm.begin(), u_comm.end());
    busy.insert(busy.end(), u_pipe.begin(), u_pipe.end());
    const auto u_busy = union_of(busy);
    for (const Interval& w : windows) {
      r.step += w.end - w.begin;
      r.gemm += length(clip(u_gemm, w));
      r.other += length(clip(u_other, w));
      r.compute += length(clip(u_compute, w));
      r.comm_exposed += length(clip(u_comm, w));
      r.pipeline_wait += length(clip(u_pipe, w));
      const auto f = clip(u_flight, w);
      r.in_flight += length(f);
      r.overlapped += length(intersect(f, clip(u_compute, w)));
      r.host += (w.end - w.begin) - length(clip(u_busy, w));
      // Host spans outside every compute span and wait (the same time host counts).
      const auto busy_w = clip(u_busy, w), host_w = clip(u_host, w);
      r.host_traced += length(host_w) - length(intersect(host_w, busy_w));
    }
    double covered = 0;
    for (const Interval& w : windows) covered += w.end - w.begin;
    r.idle = std::max(0.0, windows.back().end - windows.front().begin - covered);
    const double n = static_cast<double>(windows.size());
    for (double* f : {&r.step, &r.compute, &r.gemm, &r.other, &r.comm_exposed, &r.comm_sum, &r.pipeline_wait,
                      &r.in_flight, &r.overlapped, &r.host, &r.host_traced, &r.idle, &r.flops, &r.bytes})
      *f /= n;
    rank_steps += n;
    out.ranks.push_back(r);
  }
  if (out.ranks.empty())
    throw ConfigError("the trace has no \"step\" span to analyse: trace a training run (loom train --set trace.file=...)");
  for (auto& [name, k] : kernels) {
    k.calls /= rank_steps, k.seconds /= rank_steps, k.flops /= rank_steps, k.bytes /= rank_steps;
    out.kernels.push_back(k);
  }
  for (auto& [name, k] : wait_classes) {
    k.calls /= rank_steps, k.seconds /= rank_steps, k.bytes /= rank_steps;
    out.waits.push_back(k);
  }
  for (auto& [name, k] : host_classes) {
    k.calls /= rank_steps, k.seconds /= rank_steps;
    out.host_work.push_back(k);
  }
  auto by_time = [](const auto& a, const auto& b) { return a.seconds > b.seconds; };
  std::sort(out.kernels.begin(), out.kernels.end(), by_time);
  std::sort(out.waits.begin(), out.waits.end(), by_time);
  std::sort(out.host_work.begin(), out.host_work.end(), by_time);
  const RankBreakdown* slowest = &out.ranks.front();
  for (const auto& r : out.ranks)
    if (r.compute > slowest->compute) slowest = &r;
  out.slowest_rank = slowest->rank;
  // Stragglers: only where every rank waited on the op the same number of times (one collective each).
  const double steps = rank_steps / static_cast<double>(out.ranks.size());
  for (auto& [op, per_rank] : waits) {
    if (per_rank.size() < 2 || per_rank.size() != out.ranks.size()) continue;
    const size_t n = per_rank.begin()->second.size();
    bool same = true;
    for (auto& [rank, d] : per_rank) same = same && d.size() == n;
    if (!same || n == 0) continue;
    std::map<int, int> last_count;
    double excess = 0;
    for (size_t k = 0; k < n; ++k) {
      int last = -1;
      double least = 0;
      for (auto& [rank, d] : per_rank)
        if (last < 0 || d[k] < least) last = rank, least = d[k];
      ++last_count[last];
      for (auto& [rank, d] : per_rank) excess += d[k] - least;
    }
    StragglerWait w{op, 0, excess / steps / static_cast<double>(per_rank.size() - 1)};
    int most = -1;
    for (auto& [rank, c] : last_count)
      if (c > most) most = c, w.last_rank = rank;
    out.stragglers.push_back(w);
  }
  // Collectives named exactly: a rank that ran the op without waiting for it (no wait span) arrived last.
  struct Late {
    std::map<int, int> last_count;
    double excess = 0;  // summed over collectives, per other rank
  };
  std::map<std::string, Late> late;
  for (const auto& [key, c] : collectives) {
    if (c.wait_name.empty() || c.waited.size() < 2) continue;
    int last = -1;
    double least = 0;
    for (const auto& [rank, d] : c.waited)
      if (last < 0 || d < least) last = rank, least = d;
    double excess = 0;
    for (const auto& [rank, d] : c.waited) excess += d - least;
    auto& l = late[c.wait_name];
    ++l.last_count[last];
    l.excess += excess / static_cast<double>(c.waited.size() - 1);
  }
  for (const auto& [op, l] : late) {
    StragglerWait w{op, 0, l.excess / steps};
    int most = -1;
    for (const auto& [rank, n] : l.last_count)
      if (n > most) most = n, w.last_rank = rank;
    out.stragglers.push_back(w);
  }
  std::sort(out.stragglers.begin(), out.stragglers.end(),
            [](const auto& a, const auto& b) { return a.others_waited > b.others_waited; });
  return out;
}

}  // namespace loom::profile
