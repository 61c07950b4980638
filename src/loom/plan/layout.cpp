#include "loom/plan/layout.h"

#include <fmt/format.h>

#include "loom/error.h"
#include "loom/spec/param_table.h"
#include "loom/spec/pipeline_stages.h"

namespace loom::plan {

std::string_view schedule_name(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "gpipe";
    case Schedule::OneFOneB: return "1f1b";
    case Schedule::Interleaved: return "interleaved";
    case Schedule::ZeroBubble: return "zero-bubble";
  }
  return "?";
}
std::string_view reject_name(Reject r) {
  switch (r) {
    case Reject::None: return "ok";
    case Reject::Divisibility: return "does not divide the model";
    case Reject::Batch: return "does not divide the batch";
    case Reject::Memory: return "does not fit in memory";
    case Reject::Engine: return "is not run by the engine";
  }
  return "?";
}

std::string Layout::str() const {
  std::string s = fmt::format("dp{} tp{} pp{}", dp, tp, pp);
  if (cp > 1) s += fmt::format(" cp{}{}", cp, cp_all_to_all ? " a2a" : "");
  if (ep > 1) s += fmt::format(" ep{}", ep);
  if (vpp > 1) s += fmt::format(" v{}", vpp);
  s += fmt::format(" mb{}", micro_batch);
  if (zero) s += fmt::format(" z{}", zero);
  s += recompute == Recompute::None ? "" : recompute == Recompute::Selective ? " sel" : " full";
  if (sp) s += " sp";
  if (pp > 1 && schedule != Schedule::OneFOneB && schedule != Schedule::Interleaved)
    s += fmt::format(" {}", schedule_name(schedule));
  return s;
}

void check_job(const Job& j) {
  const auto& c = j.model.cfg;
  if (j.seq < 1) throw ConfigError(fmt::format("--seq = {} must be positive", j.seq));
  // Beyond the model's context: a rotary model is trained longer by context extension (its positions
  // are computed, and cp splits the sequence); a learned position table has max_seq rows, and Loom's
  // engine builds its RoPE tables for max_seq.
  if (j.seq > c.max_seq && (c.arch == spec::Arch::GPT2 || j.software.loom_engine))
    throw ConfigError(fmt::format(
        "--seq = {} exceeds model '{}' context of {} tokens ({}); plan a longer context on a rotary (Llama-style) "
        "model with the Megatron profile, or give the model a larger max_seq",
        j.seq, c.name, c.max_seq,
        c.arch == spec::Arch::GPT2 ? "its learned position table has that many rows" : "Loom's engine trains up to it"));
  if (j.global_batch < 1) throw ConfigError(fmt::format("--global-batch = {} must be positive", j.global_batch));
  // An explicit cut must hold the model's blocks, each chunk at least one (spec::cut_pipeline's rules).
  const auto& cut = j.software.pipeline_layers;
  if (!cut.empty()) {
    try {
      spec::cut_pipeline(c, j.seq, static_cast<int>(cut.size()), 1, cut);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string("--pipeline-layers (the planner's name for it): ") + e.what());
    }
  }
  if (j.cluster.devices < 1) throw ConfigError("the cluster has no devices");
  j.cluster.hw.peak(j.precision);  // throws for unknown / missing precision
  if (j.memory_margin < 0 || j.memory_margin >= 1)
    throw ConfigError(fmt::format("memory margin {} must lie in [0, 1)", j.memory_margin));
}

std::vector<int64_t> pipeline_cut(const Layout& l, const Job& j) {
  if (!j.software.pipeline_layers.empty()) return j.software.pipeline_layers;
  const int64_t chunks = int64_t(l.pp) * l.vpp, blocks = j.model.cfg.n_layers;
  if (l.pp == 1 || l.vpp > 1 || j.software.loom_engine || blocks % chunks == 0 || blocks < chunks) return {};
  return spec::trimmed_ends(blocks, static_cast<int>(chunks));
}

Verdict check_layout(const Layout& l, const Job& j) {
  const auto& c = j.model.cfg;
  auto div = [](std::string why) { return Verdict{Reject::Divisibility, std::move(why)}; };
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.cp < 1 || l.ep < 1 || l.vpp < 1 || l.micro_batch < 1)
    return div("every degree must be >= 1");
  if (l.devices() != j.cluster.devices)
    return div(fmt::format("dp*tp*pp*cp = {} but the cluster has {} devices", l.devices(), j.cluster.devices));
  // KV heads are split over tp, or, when fewer than tp, each replicated over tp / n_kv_heads ranks
  // (NeuronX Distributed's KV replication; the usual Llama layout at tp 16 or 32 on Trainium).
  if (c.n_heads % l.tp || !spec::tp_splits_kv_heads(c, l.tp))
    return div(fmt::format("tp = {} does not divide {} heads, or neither divides the other of tp and {} KV heads",
                           l.tp, c.n_heads, c.n_kv_heads));
  if (c.d_ff % l.tp) return div(fmt::format("tp = {} does not divide d_ff = {}", l.tp, c.d_ff));
  // The vocabulary is not checked: Megatron-style vocab-parallel embeddings pad it to a multiple of tp.
  const auto& cut = j.software.pipeline_layers;
  if (!cut.empty()) {
    if (static_cast<int64_t>(cut.size()) != int64_t(l.pp) * l.vpp || l.pp == 1)
      return div(fmt::format("--pipeline-layers gives {} chunks, not pp * vpp = {}", cut.size(), l.pp * l.vpp));
  } else if (c.n_layers < int64_t(l.pp) * l.vpp) {
    return div(fmt::format("pp * vpp = {} chunks exceed the {} layers (each chunk holds at least one)", l.pp * l.vpp,
                           c.n_layers));
  } else if (c.n_layers % (int64_t(l.pp) * l.vpp) && (j.software.loom_engine || l.vpp > 1)) {
    // (One chunk per stage is cut with the ends trimmed, pipeline_cut; interleaved chunks need an
    // explicit --pipeline-layers.)
    return div(fmt::format("pp * vpp = {} does not divide {} layers{}", l.pp * l.vpp, c.n_layers,
                           j.software.loom_engine ? "" : " (give the interleaved chunks' blocks with --pipeline-layers)"));
  }
  if (l.vpp > 1 && (l.pp == 1 || l.schedule != Schedule::Interleaved))
    return div("virtual stages need pp > 1 and the interleaved schedule");
  if (l.schedule == Schedule::Interleaved && l.vpp == 1) return div("the interleaved schedule needs vpp > 1");
  if (j.seq % (2 * l.cp) && l.cp > 1)
    return div(fmt::format("cp = {} needs seq divisible by 2*cp (load-balanced causal chunks)", l.cp));
  if (l.sp && l.tp == 1) return div("sequence parallelism needs tp > 1");
  if (l.sp && (j.seq / l.cp) % l.tp) return div("sequence parallelism needs seq/cp divisible by tp");
  if (l.zero < 0 || l.zero > 3) return div("ZeRO stage must be 0..3");
  // What the software profile runs: no SP in a stack without it, and its one recompute policy.
  if (l.sp && !j.software.sequence_parallel)
    return {Reject::Engine, fmt::format("the software profile {} has no sequence parallelism", j.software.profile)};
  if (l.zero > j.software.max_zero)
    return {Reject::Engine, fmt::format("the software profile {} shards to ZeRO-{} at most", j.software.profile,
                                        j.software.max_zero)};
  if (l.schedule == Schedule::ZeroBubble && !j.software.zero_bubble)
    return {Reject::Engine, fmt::format("the software profile {} has no zero-bubble schedule", j.software.profile)};
  if (j.software.recompute && l.recompute != *j.software.recompute)
    return {Reject::Engine, fmt::format("the software profile {} runs recompute = {}", j.software.profile,
                                        recompute_name(*j.software.recompute))};
  if (j.software.loom_engine && j.model.is_moe() && (l.cp > 1 || l.schedule == Schedule::ZeroBubble))
    return {Reject::Engine, "Loom's engine runs mixture-of-experts blocks without cp or the zero-bubble schedule"};
  if (l.cp_all_to_all && !j.software.loom_engine)
    return {Reject::Engine, fmt::format("the software profile {} is priced with the ring's point-to-point context "
                                        "parallelism; cp_mode=all-to-all is priced for Loom's engine (--software loom)",
                                        j.software.profile)};
  if (l.cp_all_to_all && l.cp > 1) {
    // Ulysses gives each cp rank whole heads of what tp left it: the same rule loom train applies.
    const int64_t heads = c.n_heads / l.tp, kv = spec::kv_heads_per_rank(c, l.tp);
    if (heads % l.cp || kv % l.cp)
      return div(fmt::format("cp = {} all-to-all needs {} query and {} KV heads per tp rank divisible by cp", l.cp,
                             heads, kv));
  }
  if (j.software.loom_engine && l.pp > 1 && l.schedule == Schedule::ZeroBubble && l.recompute != Recompute::None)
    return {Reject::Engine, "Loom's engine runs the zero-bubble schedule without recompute (its weight pass reads "
                            "GEMM inputs recompute does not keep)"};
  if (j.software.loom_engine && l.pp > 1 && l.schedule == Schedule::ZeroBubble && l.tp > 1)
    return {Reject::Engine, "Loom's engine runs the zero-bubble schedule at tp = 1 only (its TP ops do not split backward)"};
  if (j.software.loom_engine && l.pp > 1 && l.zero >= 2 && l.dp * l.cp > 1)
    return {Reject::Engine, "Loom's engine runs pipeline parallelism with ZeRO 0 or 1 (ZeRO-2/3 reduce per micro-batch backward)"};
  // Loom's engine shards the optimizer over the data replicas dp x cp (Megatron's distributed optimizer
  // over its data-parallel-with-context group does the same); the published stacks' profiles over dp.
  if (l.zero > 0 && (j.software.loom_engine ? l.dp * l.cp : l.dp) == 1)
    return div(j.software.loom_engine ? "ZeRO needs dp x cp > 1" : "ZeRO needs dp > 1");
  if (l.ep > 1) {
    if (!j.model.is_moe()) return div("ep > 1 needs a mixture-of-experts model");
    if (j.model.n_experts() % l.ep || l.dp % l.ep)
      return div(fmt::format("ep = {} must divide {} experts and dp = {}", l.ep, j.model.n_experts(), l.dp));
  }
  if (j.global_batch % (int64_t(l.dp) * l.micro_batch))
    return {Reject::Batch, fmt::format("global batch {} is not a multiple of dp * micro_batch = {}", j.global_batch,
                                       int64_t(l.dp) * l.micro_batch)};
  const int64_t m = micro_batches(l, j);
  if (l.schedule == Schedule::Interleaved && m % l.pp)
    return {Reject::Batch, fmt::format("interleaving needs micro-batches ({}) divisible by pp = {}", m, l.pp)};
  return {};
}

}  // namespace loom::plan
