#include "loom/plan/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "loom/error.h"
#include "loom/spec/context_parallel.h"

namespace loom::plan {

namespace {

// A layout size (dp, tp, ... at least 1) or a ZeRO stage (0..3). tp = 0 reached the search and
// divided by it (SIGFPE).
int parse_int(const std::string& key, const std::string& v, int lo, int hi) {
  try {
    size_t used = 0;
    int x = std::stoi(v, &used);
    if (used == v.size() && x >= lo && x <= hi) return x;
  } catch (const std::exception&) {
  }
  if (hi == std::numeric_limits<int>::max())
    throw ConfigError("--fix " + key + "=" + v + ": expected an integer >= " + std::to_string(lo));
  throw ConfigError("--fix " + key + "=" + v + ": expected an integer from " + std::to_string(lo) + " to " +
                    std::to_string(hi));
}

std::vector<int> divisors(int64_t n, int64_t limit) {
  std::vector<int> d;
  for (int64_t i = 1; i <= std::min(n, limit); ++i)
    if (n % i == 0) d.push_back(static_cast<int>(i));
  return d;
}

std::vector<int> powers_of_two_dividing(int64_t n, int64_t limit) {
  std::vector<int> d;
  for (int64_t i = 1; i <= std::min(n, limit); i *= 2)
    if (n % i == 0) d.push_back(static_cast<int>(i));
  return d;
}

// Virtual pipeline stages to try, up to 8: those whose chunks hold the blocks evenly; where pp does
// not divide the blocks, none does, and one chunk per stage is tried (the Megatron-family profiles
// cut it with the ends trimmed: pipeline_cut). At least {1}, so that a pp beyond the blocks is
// refused by check_layout, saying why.
std::vector<int> virtual_stages(const Job& j, int pp) {
  const int64_t blocks = j.model.cfg.n_layers;
  if (pp <= 1 || blocks < pp || blocks % pp != 0) return {1};
  return divisors(blocks / pp, 8);
}

template <class T>
std::vector<T> pick(const std::optional<T>& fixed, std::vector<T> all) {
  if (fixed) return {*fixed};
  return all;
}

}  // namespace

void apply_fix(Fixed& f, const std::string& kv) {
  auto eq = kv.find('=');
  if (eq == std::string::npos) throw ConfigError("--fix '" + kv + "': expected key=value");
  std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
  constexpr int kAny = std::numeric_limits<int>::max();
  // Each key once: a second value used to replace the first without a word.
  auto once = [&](auto& slot, auto value) {
    if (slot) throw ConfigError("--fix " + k + " is given twice (" + kv + "): give each layout key once");
    slot = value;
  };
  if (k == "dp") once(f.dp, parse_int(k, v, 1, kAny));
  else if (k == "tp") once(f.tp, parse_int(k, v, 1, kAny));
  else if (k == "pp") once(f.pp, parse_int(k, v, 1, kAny));
  else if (k == "cp") once(f.cp, parse_int(k, v, 1, kAny));
  else if (k == "ep") once(f.ep, parse_int(k, v, 1, kAny));
  else if (k == "v" || k == "vpp") once(f.vpp, parse_int(k, v, 1, kAny));
  else if (k == "mb" || k == "micro_batch") once(f.micro_batch, parse_int(k, v, 1, kAny));
  else if (k == "zero") once(f.zero, parse_int(k, v, 0, 3));
  else if (k == "sp") {
    if (v != "0" && v != "1" && v != "true" && v != "false") throw ConfigError("--fix sp=" + v + ": expected 0 or 1");
    once(f.sp, v == "1" || v == "true");
  } else if (k == "recompute") {
    once(f.recompute, spec::parse_recompute(v, "--fix recompute"));
  } else if (k == "schedule") {
    if (v == "gpipe") once(f.schedule, Schedule::GPipe);
    else if (v == "1f1b") once(f.schedule, Schedule::OneFOneB);
    else if (v == "interleaved") once(f.schedule, Schedule::Interleaved);
    else if (v == "zero-bubble") once(f.schedule, Schedule::ZeroBubble);
    else throw ConfigError("--fix schedule=" + v + ": valid: gpipe, 1f1b, interleaved, zero-bubble");
  } else if (k == "cp_mode") {
    once(f.cp_all_to_all, spec::parse_cp_mode(v) == spec::CpMode::AllToAll);
  } else {
    throw ConfigError("--fix '" + k +
                      "' is not a layout key (valid: dp tp pp cp cp_mode ep v mb zero sp recompute schedule)");
  }
}

SearchResult search(const Job& j, const Fixed& f, int top) {
  check_job(j);
  const auto& c = j.model.cfg;
  const int N = j.cluster.devices;
  const int dpn = j.cluster.hw.devices_per_node;
  SearchResult r;
  // The search keeps tp inside a node (a power of two dividing it); a pinned tp beyond that is priced
  // as asked -- its collectives go hierarchical, over the inter-node network -- and said so.
  if (f.tp && (*f.tp > dpn || dpn % *f.tp))
    r.warnings.push_back(fmt::format(
        "--fix tp={} is a layout the search does not try ({} devices per node: tp stays inside a node, a power of "
        "two dividing it); priced as asked: its all-reduces {} the inter-node network",
        *f.tp, dpn, *f.tp > dpn ? "cross" : "run partly on"));
  if (j.seq > c.max_seq)
    r.warnings.push_back(fmt::format(
        "--seq = {} is beyond {}'s context of {} tokens: priced as a rotary context extension (attention grows "
        "with the square of the sequence; context parallelism splits it)",
        j.seq, c.name, c.max_seq));
  std::vector<Candidate> ok;
  auto consider = [&](Layout l) {
    l.cp_all_to_all = f.cp_all_to_all.value_or(false);
    ++r.evaluated;
    Verdict v = check_layout(l, j);
    if (v.ok()) {
      MemoryBreakdown mem = memory_per_device(l, j);
      if (!mem.fits())
        v = {Reject::Memory, fmt::format("{}: needs {:.1f} GiB of {:.1f} GiB usable", l.str(), mem.total / (1 << 30),
                                         mem.usable / (1 << 30))};
      else
        return ok.push_back({l, mem, step_time(l, j)});
    }
    if (r.rejected[v.reject]++ == 0) r.example[v.reject] = v.why;
  };
  // With flash attention (Megatron's selective recompute drops the T x T scores, which flash attention
  // never stores) selective is the same layout as none, so it is only listed when asked for; Loom's
  // engine's selective drops the attention core's output instead, a layout of its own.
  // A profile that runs one policy is searched at it alone.
  const std::vector<Recompute> policies = j.software.recompute ? std::vector<Recompute>{*j.software.recompute}
                                          : j.software.flash_attention && !j.software.loom_engine
                                              ? std::vector<Recompute>{Recompute::None, Recompute::Full}
                                              : std::vector<Recompute>{Recompute::None, Recompute::Selective, Recompute::Full};
  // TP stays inside a node (its collectives run every layer); pipeline and context degrees are
  // searched as divisors; micro-batches are powers of two up to 16 sequences.
  for (int tp : pick(f.tp, powers_of_two_dividing(N, dpn)))
    for (int pp : pick(f.pp, divisors(N / std::max(1, tp), c.n_layers)))
      for (int cp : pick(f.cp, powers_of_two_dividing(N / std::max(1, tp * pp), 16))) {
        if (tp * pp * cp == 0 || N % (tp * pp * cp)) {
          Layout l{.dp = 1, .tp = tp, .pp = pp, .cp = cp};
          consider(l);
          continue;
        }
        const int dp = N / (tp * pp * cp);
        if (f.dp && *f.dp != dp) continue;
        for (int ep : pick(f.ep, j.model.is_moe() ? divisors(std::min<int64_t>(dp, j.model.n_experts()), 64) : std::vector<int>{1}))
          for (int mb : pick(f.micro_batch, powers_of_two_dividing(std::max<int64_t>(1, j.global_batch / dp), 16)))
            for (int vpp : pick(f.vpp, virtual_stages(j, pp)))
              for (Schedule sch : pick(f.schedule, vpp > 1   ? std::vector<Schedule>{Schedule::Interleaved}
                                                   : pp == 1 ? std::vector<Schedule>{Schedule::OneFOneB}
                                                   : j.software.zero_bubble
                                                       ? std::vector<Schedule>{Schedule::OneFOneB, Schedule::GPipe, Schedule::ZeroBubble}
                                                       : std::vector<Schedule>{Schedule::OneFOneB, Schedule::GPipe}))
                for (int zero : pick(f.zero, dp > 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0}))
                  if (zero <= j.software.max_zero || f.zero)  // a --fix beyond the profile is refused, saying why
                  for (Recompute rc : pick(f.recompute, policies))
                    for (bool sp : pick(f.sp, tp > 1 && j.software.sequence_parallel ? std::vector<bool>{false, true}
                                                                                       : std::vector<bool>{false}))
                      consider(Layout{dp, tp, pp, cp, ep, vpp, mb, zero, sp, rc, sch});
      }
  r.feasible = static_cast<int64_t>(ok.size());
  if (ok.empty()) {
    std::string why;
    for (auto& [reason, count] : r.rejected)
      why += fmt::format("{}{} {} (e.g. {})", why.empty() ? "" : "; ", count, reject_name(reason), r.example[reason]);
    throw ConfigError(fmt::format("no layout of {} on {} x {} fits: {} layouts tried; {}", c.name, N, j.cluster.hw.name,
                                  r.evaluated, why.empty() ? "none could be formed" : why));
  }
  std::sort(ok.begin(), ok.end(), [](const Candidate& a, const Candidate& b) {
    if (a.time.total != b.time.total) return a.time.total < b.time.total;
    return a.memory.total < b.memory.total;  // equal time: the smaller footprint
  });
  if (top > 0 && static_cast<int>(ok.size()) > top) ok.resize(top);
  r.ranked = std::move(ok);
  return r;
}

std::vector<Sensitivity> sensitivity(const Job& job, const Fixed& fixed, const Layout& layout) {
  struct Knob {
    const char* name;
    std::function<void(Hardware&, double)> scale;
    bool lower_is_better = false;
  };
  const std::vector<Knob> knobs = {
      {"peak FLOP/s",
       [](Hardware& h, double x) {
         h.device.peak_bf16 *= x, h.device.peak_fp8 *= x, h.device.peak_f32 *= x;
         for (auto& g : h.gemm_table) g.flops_per_s *= x;  // measured GEMM rates scale with the peak too
         for (auto& a : h.attention_table) a.flops_per_s *= x;
       }},
      {"memory bandwidth", [](Hardware& h, double x) { h.device.memory_bandwidth *= x; }},
      {"memory capacity", [](Hardware& h, double x) { h.device.memory_bytes *= x; }},
      {"intra-node link", [](Hardware& h, double x) { h.intra_node.bandwidth *= x; }},
      {"inter-node network", [](Hardware& h, double x) { h.inter_node.bandwidth *= x; }},
      {"link latency", [](Hardware& h, double x) { h.intra_node.latency *= x, h.inter_node.latency *= x; }, true},
  };
  std::vector<Sensitivity> out;
  for (auto& k : knobs)
    for (double factor : {2.0, 0.5}) {
      Job j = job;
      k.scale(j.cluster.hw, factor);
      Sensitivity s{k.name, factor, (factor > 1) != k.lower_is_better, 0, 0};
      if (memory_per_device(layout, j).fits()) s.same_layout = step_time(layout, j).total;
      try {
        s.replanned = search(j, fixed, 1).ranked.front().time.total;
      } catch (const ConfigError&) {
      }
      out.push_back(s);
    }
  return out;
}

SensitivityVerdict sensitivity_verdict(const std::vector<Sensitivity>& rows, double base) {
  SensitivityVerdict v;
  double best = 0, worst = -1;
  for (const Sensitivity& s : rows) {
    const double change = s.replanned > 0 ? s.replanned / base - 1 : std::numeric_limits<double>::infinity();
    if (s.better && change < best) best = change, v.pays_most = s.figure;
    if (!s.better && change > worst) worst = change, v.hurts_most = s.figure;
  }
  v.gain = best, v.loss = std::max(0.0, worst);
  return v;
}

}  // namespace loom::plan
