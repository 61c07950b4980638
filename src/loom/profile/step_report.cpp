#include "loom/profile/step_report.h"

#include <fmt/format.h>

#include <algorithm>

namespace loom::profile {

namespace {

KernelRoof place(const KernelClass& k, const Roofline& roof) {
  KernelRoof r;
  r.k = k;
  r.intensity = k.bytes > 0 ? k.flops / k.bytes : 0;
  // Without a bandwidth only GEMMs are taken as compute-bound; with one, the ridge decides.
  r.compute_bound = roof.bandwidth > 0 ? (k.bytes <= 0 ? k.flops > 0 : r.intensity >= roof.ridge())
                                       : k.category == Category::Gemm;
  if (k.seconds <= 0) return r;
  if (r.compute_bound) {
    r.achieved = k.flops / k.seconds;
    r.roof = roof.peak_flops;
  } else {
    r.achieved = k.bytes / k.seconds;
    r.roof = roof.bandwidth;
  }
  return r;
}

double ms(double s) { return 1e3 * s; }

}  // namespace

StepReport build_report(const TraceAnalysis& analysis, const Roofline& roof, const RunFacts& facts) {
  StepReport r;
  r.analysis = analysis, r.roof = roof, r.facts = facts;
  const RankBreakdown m = analysis.mean();
  double cb = 0, mb = 0;
  for (const auto& k : analysis.kernels) {
    r.kernels.push_back(place(k, roof));
    (r.kernels.back().compute_bound ? cb : mb) += k.seconds;
  }
  // Kernel time split in the ratio of the kernels' own time, scaled to the compute union (spans that
  // nest or run on several threads count once).
  const double kernel_total = cb + mb;
  r.compute_bound = kernel_total > 0 ? m.compute * cb / kernel_total : 0;
  r.memory_bound = kernel_total > 0 ? m.compute * mb / kernel_total : 0;
  r.collectives = m.comm_exposed;
  r.pipeline = m.pipeline_wait;
  r.host = m.host;
  const std::pair<const char*, double> classes[] = {{"compute", r.compute_bound},
                                                    {"memory", r.memory_bound},
                                                    {"collectives", r.collectives},
                                                    {"pipeline bubble", r.pipeline},
                                                    {"host overhead", r.host}};
  const auto top = std::max_element(std::begin(classes), std::end(classes),
                                    [](const auto& a, const auto& b) { return a.second < b.second; });
  r.bound_by = top->first;
  r.bound_share = m.step > 0 ? top->second / m.step : 0;
  const double ranks = static_cast<double>(analysis.ranks.size());
  if (m.step > 0 && roof.peak_flops > 0) {
    r.hfu = m.flops / m.step / roof.peak_flops;
    if (facts.tokens_per_step > 0)
      r.mfu = facts.tokens_per_step * facts.model_flops_per_token / m.step / (roof.peak_flops * ranks);
  }
  if (m.step > 0 && roof.bandwidth > 0) r.bandwidth_utilisation = m.bytes / m.step / roof.bandwidth;

  // Opportunities: what each class could give back at most, and where its fix belongs.
  std::vector<Opportunity> all;
  auto lost = [&](bool compute_bound) {
    double s = 0;
    const KernelRoof* worst = nullptr;
    double worst_lost = 0;
    for (const auto& k : r.kernels) {
      if (k.compute_bound != compute_bound || k.roof <= 0) continue;
      const double l = k.k.seconds * std::max(0.0, 1 - k.share_of_roof());
      s += l;
      if (l > worst_lost) worst_lost = l, worst = &k;
    }
    return std::pair{s * (kernel_total > 0 ? m.compute / kernel_total : 0), worst};
  };
  if (auto [s, k] = lost(true); k)
    all.push_back({"kernel", fmt::format("compute-bound kernels run below the {:.0f} GFLOP/s peak; the largest loss is {} "
                                         "at {:.0f}% of it", roof.peak_flops * 1e-9, k->k.name, 100 * k->share_of_roof()),
                   s});
  if (auto [s, k] = lost(false); k)
    all.push_back({"kernel", fmt::format("memory-bound kernels run below the {:.1f} GB/s roof; the largest loss is {} at "
                                         "{:.0f}% of it: fuse it with its neighbours (fewer sweeps over memory)",
                                         roof.bandwidth * 1e-9, k->k.name, 100 * k->share_of_roof()),
                   s});
  if (r.collectives > 0) {
    std::string largest;
    for (const auto& w : analysis.waits)
      if (!is_pipeline_wait(w.name)) {
        largest = w.name;
        break;
      }
    // The waits split in two: what the others spent waiting for a straggler (its fix is balance, in
    // the layout) and the rest (the collectives themselves: overlap, or a faster algorithm).
    const StragglerWait* st = analysis.stragglers.empty() ? nullptr : &analysis.stragglers.front();
    const double late = st && st->others_waited > 0.3 * r.collectives ? std::min(st->others_waited, r.collectives) : 0;
    if (late > 0)
      all.push_back({"parallel layout",
                     fmt::format("rank {} arrives last at {}: the others wait {:.1f} ms per step for it; balance the "
                                 "work between ranks (data, stages) or find what slows that rank",
                                 st->last_rank, st->op, ms(st->others_waited)),
                     late});
    if (r.collectives - late > 0)
      all.push_back({"collective algorithm",
                     fmt::format("{:.1f} ms per step of collectives are waited for{} (largest: {}); overlap them with "
                                 "compute (parallel.bucket_kb, tp_overlap) or pick a faster algorithm",
                                 ms(r.collectives - late), late > 0 ? " beyond the straggler's" : "",
                                 largest.empty() ? "collective work run inline, no wait traced" : largest),
                     r.collectives - late});
  }
  if (r.pipeline > 0)
    all.push_back({"parallel layout",
                   fmt::format("pipeline stages wait {:.1f} ms per step on each other (the bubble and exposed "
                               "transfers): more micro-batches per step, interleaved-1f1b or zb-h1",
                               ms(r.pipeline)),
                   r.pipeline});
  if (r.host > 0) {
    // Most of it in traced host work (data loading, checkpoints): name the largest.
    const bool traced = m.host_traced > 0.5 * r.host && !analysis.host_work.empty();
    all.push_back({"host loop",
                   traced ? fmt::format("{:.1f} ms per step run outside every kernel and wait, {:.1f} ms of it in {} "
                                        "(the largest host span): overlap it with compute or make it cheaper",
                                        ms(r.host), ms(m.host_traced), analysis.host_work.front().name)
                          : fmt::format("{:.1f} ms per step run outside every kernel and wait (launching, bookkeeping, "
                                        "data loading)",
                                        ms(r.host)),
                   r.host});
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  for (const auto& o : all)
    if (o.seconds > 0 && r.opportunities.size() < 3) r.opportunities.push_back(o);
  return r;
}

ExpertExchange expert_exchange(const TraceAnalysis& a) {
  ExpertExchange e;
  auto expert = [](const std::string& name) { return name.rfind("ep_", 0) == 0; };
  for (const auto& w : a.waits)
    if (expert(w.name)) e.exposed += w.seconds;
  for (const auto& s : a.stragglers)  // by others_waited, descending
    if (expert(s.op)) {
      e.straggler = s;
      break;
    }
  return e;
}

std::string format_report(const StepReport& r) {
  const auto& a = r.analysis;
  const RankBreakdown m = a.mean();
  auto pct = [&](double s) { return m.step > 0 ? 100 * s / m.step : 0.0; };
  std::string out = fmt::format("{} rank(s), {} step(s) analysed per rank; roofline: peak {:.1f} GFLOP/s, memory {} ({})\n",
                                a.ranks.size(), m.steps, r.roof.peak_flops * 1e-9,
                                r.roof.bandwidth > 0 ? fmt::format("{:.1f} GB/s", r.roof.bandwidth * 1e-9) : "unknown",
                                r.roof.source);
  // Per rank and for the job (the ranks' mean), ms per step.
  out += fmt::format("{:<34}", "ms per step");
  for (const auto& x : a.ranks) out += fmt::format(" {:>9}", fmt::format("rank {}", x.rank));
  out += fmt::format(" {:>9} {:>7}\n", "job", "share");
  auto row = [&](const char* name, double RankBreakdown::*f) {
    out += fmt::format("{:<34}", name);
    for (const auto& x : a.ranks) out += fmt::format(" {:>9.2f}", ms(x.*f));
    out += fmt::format(" {:>9.2f} {:>6.1f}%\n", ms(m.*f), pct(m.*f));
  };
  row("step", &RankBreakdown::step);
  row("compute (union)", &RankBreakdown::compute);
  row("  GEMM", &RankBreakdown::gemm);
  row("  other kernels", &RankBreakdown::other);
  row("communication exposed (union)", &RankBreakdown::comm_exposed);
  row("communication waits (sum)", &RankBreakdown::comm_sum);
  row("async collectives in flight", &RankBreakdown::in_flight);
  row("  of it overlapped with compute", &RankBreakdown::overlapped);
  row("pipeline waits (bubble)", &RankBreakdown::pipeline_wait);
  row("host overhead", &RankBreakdown::host);
  row("  of it in host spans (data, ...)", &RankBreakdown::host_traced);
  row("idle between steps", &RankBreakdown::idle);
  out += fmt::format("MFU {} | HFU {:.1f}% | memory bandwidth {}\n",
                     r.facts.tokens_per_step > 0 ? fmt::format("{:.1f}%", 100 * r.mfu) : std::string("n/a (no manifest)"),
                     100 * r.hfu,
                     r.roof.bandwidth > 0 ? fmt::format("{:.1f}% of the roof", 100 * r.bandwidth_utilisation) : "n/a");
  out += fmt::format("\n{:<26} {:>7} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}\n", "kernel (per step, rank mean)", "calls",
                     "ms", "GFLOP/s", "GB/s", "FLOP/B", "bound", "of roof");
  int n = 0;
  bool above = false;  // a memory-bound kernel past the memory roof: its data stayed in cache
  for (const auto& k : r.kernels) {
    if (n++ >= 12) break;
    const double s = k.k.seconds;
    const bool cached = !k.compute_bound && k.share_of_roof() > 1;
    above = above || cached;
    out += fmt::format("{:<26} {:>7.1f} {:>9.2f} {:>9.1f} {:>8.1f} {:>8.1f} {:>8} {:>7}\n", k.k.name, k.k.calls, ms(s),
                       s > 0 ? k.k.flops / s * 1e-9 : 0.0, s > 0 ? k.k.bytes / s * 1e-9 : 0.0, k.intensity,
                       k.compute_bound ? "compute" : "memory",
                       k.roof > 0 ? fmt::format("{:.0f}%{}", 100 * k.share_of_roof(), cached ? "*" : "")
                                  : std::string("?"));
  }
  if (above) out += "* past the memory roof: the kernel's data stayed in cache (the roof is DRAM's streaming rate)\n";
  if (a.ranks.size() > 1) {
    const auto& slow = *std::find_if(a.ranks.begin(), a.ranks.end(), [&](const auto& x) { return x.rank == a.slowest_rank; });
    out += fmt::format("\nslowest rank: {} ({:.2f} ms of compute per step against the mean {:.2f})", slow.rank,
                       ms(slow.compute), ms(m.compute));
    if (!a.stragglers.empty())
      out += fmt::format("; the others waited for rank {} {:.2f} ms per step at {}", a.stragglers.front().last_rank,
                         ms(a.stragglers.front().others_waited), a.stragglers.front().op);
    out += "\n";
  }
  if (const ExpertExchange e = expert_exchange(a); e.exposed > 0) {
    out += fmt::format("\nexpert parallelism: the experts' all-to-alls (ep_*) exposed {:.2f} ms per step ({:.1f}% of the "
                       "step, rank mean)",
                       ms(e.exposed), pct(e.exposed));
    if (e.straggler)
      out += fmt::format("; the straggling expert rank: {} (the others waited {:.2f} ms per step for it at {})",
                         e.straggler->last_rank, ms(e.straggler->others_waited), e.straggler->op);
    out += "\n";
  }
  out += fmt::format("\nverdict: bound by {}: {:.0f}% of the step\n", r.bound_by, 100 * r.bound_share);
  for (size_t i = 0; i < r.opportunities.size(); ++i) {
    const auto& o = r.opportunities[i];
    out += fmt::format("  {}. [{}] up to {:.1f} ms per step ({:.0f}%): {}\n", i + 1, o.where, ms(o.seconds),
                       pct(o.seconds), o.what);
  }
  return out;
}

nlohmann::json report_json(const StepReport& r) {
  auto rank_json = [](const RankBreakdown& x) {
    return nlohmann::json{{"rank", x.rank},         {"steps", x.steps},
                          {"step_s", x.step},       {"compute_s", x.compute},
                          {"gemm_s", x.gemm},       {"other_kernels_s", x.other},
                          {"comm_exposed_s", x.comm_exposed}, {"comm_sum_s", x.comm_sum},
                          {"in_flight_s", x.in_flight},       {"overlapped_s", x.overlapped},
                          {"pipeline_wait_s", x.pipeline_wait}, {"host_s", x.host},
                          {"idle_s", x.idle},       {"host_traced_s", x.host_traced},
                          {"flops", x.flops},
                          {"bytes", x.bytes}};
  };
  nlohmann::json j;
  for (const auto& x : r.analysis.ranks) j["ranks"].push_back(rank_json(x));
  j["job"] = rank_json(r.analysis.mean());
  for (const auto& k : r.kernels)
    j["kernels"].push_back({{"name", k.k.name},
                            {"calls", k.k.calls},
                            {"seconds", k.k.seconds},
                            {"flops", k.k.flops},
                            {"bytes", k.k.bytes},
                            {"bound", k.compute_bound ? "compute" : "memory"},
                            {"share_of_roof", k.share_of_roof()}});
  j["roofline"] = {{"peak_flops", r.roof.peak_flops}, {"bandwidth", r.roof.bandwidth}, {"source", r.roof.source}};
  j["classes_s"] = {{"compute", r.compute_bound}, {"memory", r.memory_bound}, {"collectives", r.collectives},
                    {"pipeline", r.pipeline},     {"host", r.host}};
  j["verdict"] = {{"bound_by", r.bound_by}, {"share", r.bound_share}};
  j["mfu"] = r.mfu, j["hfu"] = r.hfu, j["bandwidth_utilisation"] = r.bandwidth_utilisation;
  j["slowest_rank"] = r.analysis.slowest_rank;
  for (const auto& s : r.analysis.stragglers)
    j["stragglers"].push_back({{"op", s.op}, {"last_rank", s.last_rank}, {"others_waited_s", s.others_waited}});
  if (const ExpertExchange e = expert_exchange(r.analysis); e.exposed > 0) {
    j["expert_parallel"] = {{"exposed_s", e.exposed}};
    if (e.straggler)
      j["expert_parallel"]["straggler"] = {{"rank", e.straggler->last_rank}, {"op", e.straggler->op},
                                           {"others_waited_s", e.straggler->others_waited}};
  }
  for (const auto& o : r.opportunities)
    j["opportunities"].push_back({{"where", o.where}, {"what", o.what}, {"seconds", o.seconds}});
  return j;
}

}  // namespace loom::profile
