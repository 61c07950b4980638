#include "loom/spec/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <tuple>

#include "loom/error.h"

namespace loom::spec {

namespace {

int duration(Pass p) { return p == Pass::Backward ? 2 : 1; }

std::vector<PipelineAction> gpipe(int m) {
  std::vector<PipelineAction> a;
  for (int i = 0; i < m; ++i) a.push_back({i, 0, Pass::Forward});
  for (int i = 0; i < m; ++i) a.push_back({i, 0, Pass::Backward});
  return a;
}

// PipeDream-flush: pp - r - 1 warm-up forwards, then one forward and one backward in turn, then the
// remaining backwards.
std::vector<PipelineAction> one_f_one_b(int pp, int r, int m, Pass backward) {
  std::vector<PipelineAction> a;
  const int warm = std::min(pp - r - 1, m);
  for (int i = 0; i < warm; ++i) a.push_back({i, 0, Pass::Forward});
  for (int i = 0; i < m - warm; ++i) {
    a.push_back({warm + i, 0, Pass::Forward});
    a.push_back({i, 0, backward});
  }
  for (int i = m - warm; i < m; ++i) a.push_back({i, 0, backward});
  return a;
}

// Megatron-LM's interleaved 1F1B: the k-th forward of a rank is micro-batch (k / (pp v)) pp + k % pp of
// local chunk (k / pp) % v; backwards run the chunks in reverse. Warm-up: 2 (pp - r - 1) + (v - 1) pp.
std::vector<PipelineAction> interleaved(int pp, int v, int r, int m) {
  const int total = m * v;
  auto mb = [&](int k) { return (k / (pp * v)) * pp + k % pp; };
  auto fwd = [&](int k) { return PipelineAction{mb(k), (k / pp) % v, Pass::Forward}; };
  auto bwd = [&](int k) { return PipelineAction{mb(k), v - 1 - (k / pp) % v, Pass::Backward}; };
  const int warm = std::min(2 * (pp - r - 1) + (v - 1) * pp, total);
  std::vector<PipelineAction> a;
  int f = 0, b = 0;
  for (; f < warm; ++f) a.push_back(fwd(f));
  while (f < total) {
    a.push_back(fwd(f++));
    a.push_back(bwd(b++));
  }
  while (b < total) a.push_back(bwd(b++));
  return a;
}

// What a simulation needs to know of one pass of one micro-batch chunk.
using Key = std::tuple<int, int, Pass>;  // micro-batch, global chunk, pass

struct Timeline {
  std::map<Key, int64_t> finish;  // when each started pass ends
  bool done(int mb, int g, Pass p, int64_t t) const {
    auto it = finish.find({mb, g, p});
    return it != finish.end() && it->second <= t;
  }
};

// Whether the inputs of `a` (on `rank`) are there at time t.
bool ready(const PipelinePlan& plan, const Timeline& tl, int rank, const PipelineAction& a, int64_t t) {
  const int g = plan.global_chunk(rank, a.chunk), last = plan.pp * plan.v - 1;
  switch (a.pass) {
    case Pass::Forward:
      return g == 0 || tl.done(a.micro_batch, g - 1, Pass::Forward, t);
    case Pass::Backward:
    case Pass::BackwardInput: {
      if (!tl.done(a.micro_batch, g, Pass::Forward, t)) return false;
      if (g == last) return true;
      return tl.done(a.micro_batch, g + 1, Pass::Backward, t) || tl.done(a.micro_batch, g + 1, Pass::BackwardInput, t);
    }
    case Pass::BackwardWeight:
      return tl.done(a.micro_batch, g, Pass::BackwardInput, t);
  }
  return false;
}

// Zero-bubble H1: the 1F1B order of forwards and input-gradient passes; the weight-gradient passes
// are placed by a unit-time simulation into the slots where the rank would otherwise wait, and before a
// forward that would hold more micro-batches than 1F1B does (pp - r), so peak activation memory stays
// 1F1B's.
PipelinePlan zero_bubble_h1(int pp, int m) {
  PipelinePlan plan{PipelineSchedule::ZeroBubbleH1, pp, 1, m, std::vector<std::vector<PipelineAction>>(pp)};
  std::vector<std::vector<PipelineAction>> main(pp);
  for (int r = 0; r < pp; ++r) main[r] = one_f_one_b(pp, r, m, Pass::BackwardInput);
  std::vector<size_t> next(pp, 0);
  std::vector<std::vector<int>> pending(pp);  // micro-batches whose BI is done and BW not yet run
  std::vector<int> in_flight(pp, 0);
  std::vector<int64_t> free_at(pp, 0);
  Timeline tl;
  int64_t t = 0;
  size_t remaining = static_cast<size_t>(pp) * 3 * static_cast<size_t>(m);
  while (remaining > 0) {
    bool started = false;
    for (int r = 0; r < pp; ++r) {
      if (free_at[r] > t) continue;
      // BI passes that have ended leave their BW pending.
      std::optional<PipelineAction> run;
      const int limit = std::min(m, pp - r);
      const bool has_main = next[r] < main[r].size();
      const PipelineAction* nm = has_main ? &main[r][next[r]] : nullptr;
      const bool main_ready = nm && ready(plan, tl, r, *nm, t);
      const bool over = nm && nm->pass == Pass::Forward && in_flight[r] >= limit;
      auto ready_w = [&]() -> int {
        for (size_t i = 0; i < pending[r].size(); ++i)
          if (tl.done(pending[r][i], r, Pass::BackwardInput, t)) return static_cast<int>(i);
        return -1;
      };
      if (main_ready && !over) {
        run = *nm;
        ++next[r];
      } else if (int w = ready_w(); w >= 0) {
        run = PipelineAction{pending[r][static_cast<size_t>(w)], 0, Pass::BackwardWeight};
        pending[r].erase(pending[r].begin() + w);
      }
      if (!run) continue;
      plan.ranks[r].push_back(*run);
      tl.finish[{run->micro_batch, r, run->pass}] = t + duration(run->pass);
      free_at[r] = t + duration(run->pass);
      if (run->pass == Pass::Forward) ++in_flight[r];
      if (run->pass == Pass::BackwardInput) pending[r].push_back(run->micro_batch);
      if (run->pass == Pass::BackwardWeight) --in_flight[r];
      --remaining;
      started = true;
    }
    if (remaining == 0) break;
    // Advance to the next moment anything ends.
    int64_t next_t = std::numeric_limits<int64_t>::max();
    for (const auto& [k, f] : tl.finish)
      if (f > t) next_t = std::min(next_t, f);
    if (next_t == std::numeric_limits<int64_t>::max()) {
      if (!started) throw Error("internal: the zero-bubble schedule construction is stuck");
      next_t = t + 1;
    }
    t = next_t;
  }
  return plan;
}

}  // namespace

const char* schedule_name(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::GPipe: return "gpipe";
    case PipelineSchedule::OneFOneB: return "1f1b";
    case PipelineSchedule::Interleaved1F1B: return "interleaved-1f1b";
    case PipelineSchedule::ZeroBubbleH1: return "zb-h1";
  }
  return "?";
}

PipelineSchedule parse_schedule(const std::string& name) {
  for (auto s : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved1F1B,
                 PipelineSchedule::ZeroBubbleH1})
    if (name == schedule_name(s)) return s;
  throw ConfigError("parallel.pipeline.schedule = \"" + name +
                    "\" is not a schedule (\"gpipe\", \"1f1b\", \"interleaved-1f1b\", \"zb-h1\")");
}

const char* pass_name(Pass p) {
  switch (p) {
    case Pass::Forward: return "F";
    case Pass::Backward: return "B";
    case Pass::BackwardInput: return "BI";
    case Pass::BackwardWeight: return "BW";
  }
  return "?";
}

PipelinePlan build_pipeline_schedule(PipelineSchedule kind, int pp, int v, int m) {
  const std::string name = schedule_name(kind);
  if (pp < 1) throw ConfigError("parallel.pp = " + std::to_string(pp) + " must be at least 1");
  if (m < 1) throw ConfigError("a pipeline step needs at least one micro-batch, got " + std::to_string(m));
  if (kind == PipelineSchedule::Interleaved1F1B) {
    if (v < 2)
      throw ConfigError("parallel.pipeline.schedule = \"interleaved-1f1b\" needs parallel.pipeline.virtual_stages >= 2 "
                        "(got " + std::to_string(v) + "); use \"1f1b\" for one chunk per rank");
    if (m % pp != 0)
      throw ConfigError("interleaved-1f1b runs micro-batches in groups of pp = " + std::to_string(pp) + ": " +
                        std::to_string(m) + " micro-batches per step is not a multiple; use " +
                        std::to_string((m + pp - 1) / pp * pp) + (m >= pp ? " or " + std::to_string(m / pp * pp) : ""));
  } else if (v != 1) {
    throw ConfigError("parallel.pipeline.virtual_stages = " + std::to_string(v) + " needs the \"interleaved-1f1b\" "
                      "schedule; \"" + name + "\" runs one chunk per rank (set virtual_stages = 1)");
  }
  if (kind == PipelineSchedule::ZeroBubbleH1) return zero_bubble_h1(pp, m);
  PipelinePlan plan{kind, pp, v, m, {}};
  for (int r = 0; r < pp; ++r) {
    switch (kind) {
      case PipelineSchedule::GPipe: plan.ranks.push_back(gpipe(m)); break;
      case PipelineSchedule::OneFOneB: plan.ranks.push_back(one_f_one_b(pp, r, m, Pass::Backward)); break;
      case PipelineSchedule::Interleaved1F1B: plan.ranks.push_back(interleaved(pp, v, r, m)); break;
      case PipelineSchedule::ZeroBubbleH1: break;
    }
  }
  return plan;
}

ScheduleRun simulate(const PipelinePlan& plan) {
  ScheduleRun out;
  const int pp = plan.pp;
  // Every rank must run each of its chunks' passes once per micro-batch: F, and B or BI + BW.
  for (int r = 0; r < pp; ++r) {
    std::map<Key, int> seen;
    for (const auto& a : plan.ranks[static_cast<size_t>(r)]) {
      if (a.chunk < 0 || a.chunk >= plan.v || a.micro_batch < 0 || a.micro_batch >= plan.micro_batches) {
        out.problem = "rank " + std::to_string(r) + " runs micro-batch " + std::to_string(a.micro_batch) + " chunk " +
                      std::to_string(a.chunk) + ", outside the plan";
        return out;
      }
      if (++seen[{a.micro_batch, a.chunk, a.pass}] > 1) {
        out.problem = "rank " + std::to_string(r) + " runs " + pass_name(a.pass) + " of micro-batch " +
                      std::to_string(a.micro_batch) + " chunk " + std::to_string(a.chunk) + " twice";
        return out;
      }
    }
    for (int mb = 0; mb < plan.micro_batches; ++mb)
      for (int c = 0; c < plan.v; ++c) {
        const bool whole = seen.count({mb, c, Pass::Backward}) > 0;
        const bool split = seen.count({mb, c, Pass::BackwardInput}) > 0 && seen.count({mb, c, Pass::BackwardWeight}) > 0;
        if (!seen.count({mb, c, Pass::Forward}) || whole == split) {
          out.problem = "rank " + std::to_string(r) + " does not run micro-batch " + std::to_string(mb) + " chunk " +
                        std::to_string(c) + " exactly once forward and once backward";
          return out;
        }
      }
  }
  Timeline tl;
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  std::vector<int64_t> free_at(static_cast<size_t>(pp), 0), busy(static_cast<size_t>(pp), 0);
  std::vector<int> in_flight(static_cast<size_t>(pp), 0);
  out.peak_in_flight.assign(static_cast<size_t>(pp), 0);
  // A chunk's activations are held from its forward until its backward (B, or BW when split).
  int64_t t = 0;
  for (;;) {
    bool all_done = true;
    for (int r = 0; r < pp; ++r) {
      const auto ur = static_cast<size_t>(r);
      if (next[ur] >= plan.ranks[ur].size()) continue;
      all_done = false;
      if (free_at[ur] > t) continue;
      const auto& a = plan.ranks[ur][next[ur]];
      if (!ready(plan, tl, r, a, t)) continue;
      const int g = plan.global_chunk(r, a.chunk), d = duration(a.pass);
      tl.finish[{a.micro_batch, g, a.pass}] = t + d;
      free_at[ur] = t + d;
      busy[ur] += d;
      ++next[ur];
      if (a.pass == Pass::Forward) {
        out.peak_in_flight[ur] = std::max(out.peak_in_flight[ur], ++in_flight[ur]);
      } else if (a.pass == Pass::Backward || a.pass == Pass::BackwardWeight) {
        --in_flight[ur];
      }
    }
    if (all_done) break;
    int64_t next_t = std::numeric_limits<int64_t>::max();
    for (const auto& [k, f] : tl.finish)
      if (f > t) next_t = std::min(next_t, f);
    if (next_t == std::numeric_limits<int64_t>::max()) {
      // Nothing running and nothing can start: every unfinished rank waits on an input that never comes.
      std::string who;
      for (int r = 0; r < pp; ++r) {
        const auto ur = static_cast<size_t>(r);
        if (next[ur] >= plan.ranks[ur].size()) continue;
        const auto& a = plan.ranks[ur][next[ur]];
        who += (who.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " waits to run " +
               pass_name(a.pass) + " of micro-batch " + std::to_string(a.micro_batch) + " chunk " +
               std::to_string(a.chunk);
      }
      out.problem = "deadlock at time " + std::to_string(t) + ": " + who;
      return out;
    }
    t = next_t;
  }
  out.makespan = 0;
  for (const auto& [k, f] : tl.finish) out.makespan = std::max(out.makespan, f);
  for (int r = 0; r < pp; ++r)
    out.idle.push_back(out.makespan > 0 ? 1.0 - static_cast<double>(busy[static_cast<size_t>(r)]) /
                                                  static_cast<double>(out.makespan)
                                        : 0.0);
  out.ok = true;
  return out;
}

std::vector<PipelineAction> evaluation_order(int v, int micro_batches) {
  std::vector<PipelineAction> actions;
  for (int m = 0; m < micro_batches; ++m)
    for (int c = 0; c < v; ++c) actions.push_back({m, c, Pass::Forward});
  return actions;
}

std::vector<int> contexts_held(const PipelinePlan& plan, int rank, bool evaluation) {
  const auto& actions = evaluation ? evaluation_order(plan.v, plan.micro_batches) : plan.ranks.at(static_cast<size_t>(rank));
  std::vector<int> held(static_cast<size_t>(plan.v), 0), peak(held);
  std::vector<std::vector<int>> taken(static_cast<size_t>(plan.v));  // micro-batches holding one, per chunk
  auto take = [&](const PipelineAction& a) {
    auto& t = taken[static_cast<size_t>(a.chunk)];
    if (a.pass != Pass::Forward || std::find(t.begin(), t.end(), a.micro_batch) != t.end()) return;
    t.push_back(a.micro_batch);
    peak[static_cast<size_t>(a.chunk)] = std::max(peak[static_cast<size_t>(a.chunk)], ++held[static_cast<size_t>(a.chunk)]);
  };
  // A forward receives unless its chunk is the model's first.
  auto receives = [&](const PipelineAction& a) { return a.pass == Pass::Forward && plan.global_chunk(rank, a.chunk) != 0; };
  if (!actions.empty() && receives(actions.front())) take(actions.front());
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    take(a);
    if (i + 1 < actions.size() && receives(actions[i + 1])) take(actions[i + 1]);
    // The last backward of a micro-batch on a chunk (Backward, or BackwardWeight when split) gives it back.
    if (a.pass == Pass::Backward || a.pass == Pass::BackwardWeight || evaluation) {
      auto& t = taken[static_cast<size_t>(a.chunk)];
      t.erase(std::remove(t.begin(), t.end(), a.micro_batch), t.end());
      --held[static_cast<size_t>(a.chunk)];
    }
  }
  return peak;
}

double theoretical_bubble(const PipelinePlan& plan) {
  const double p = plan.pp, m = plan.micro_batches;
  switch (plan.kind) {
    case PipelineSchedule::GPipe:
    case PipelineSchedule::OneFOneB: return (p - 1) / (m + p - 1);
    case PipelineSchedule::Interleaved1F1B: return (p - 1) / (m + p - 1) / plan.v;
    case PipelineSchedule::ZeroBubbleH1: {
      const auto run = simulate(plan);
      double sum = 0;
      for (double x : run.idle) sum += x;
      return run.idle.empty() ? 0 : sum / static_cast<double>(run.idle.size());
    }
  }
  return 0;
}

}  // namespace loom::spec
