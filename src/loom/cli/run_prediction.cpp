#include "loom/cli/run_prediction.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "loom/error.h"
#include "loom/plan/engine_memory.h"
#include "loom/spec/context_parallel.h"
#include "loom/plan/layout.h"
#include "loom/plan/software_profile.h"
#include "loom/spec/pipeline_schedule.h"
#include "loom/spec/pipeline_stages.h"

namespace loom::cli {

namespace {

// One rank's device. A CPU machine file (one device per node) is the whole machine: the run's ranks
// split its cores, so each gets its share of the peaks, of the memory bandwidth and of the memory.
plan::Hardware rank_device(const plan::Hardware& machine, int world, std::string& source) {
  if (machine.devices_per_node != 1 || world <= 1) return machine;
  const bool timed = std::any_of(machine.gemm_table.begin(), machine.gemm_table.end(),
                                 [&](const plan::MeasuredGemm& g) { return g.ranks == world; });
  const bool attention = std::any_of(machine.attention_table.begin(), machine.attention_table.end(),
                                     [&](const plan::MeasuredAttention& a) { return a.ranks == world; });
  source += fmt::format(", one device shared by {} ranks{}", world,
                        timed ? attention ? " (its layer GEMMs and attention timed per rank)" : " (its layer GEMMs timed per rank)"
                              : "");
  return plan::rank_share(machine, world);
}

// Without a machine file: the report's roofline (the run's peak, the bandwidth measured now). Nothing
// says how GEMM efficiency falls with size, how fast attention runs or what a link does, so GEMMs
// run at the peak, attention on that curve, and links at half the streaming bandwidth (what `loom
// calibrate --no-comm` assumes).
plan::Hardware roofline_device(const profile::Roofline& roof, int world) {
  plan::Hardware hw;
  hw.name = "roofline";
  hw.source = "the report's roofline";
  hw.device.name = "one rank";
  hw.device.peak_f32 = hw.device.peak_bf16 = roof.peak_flops;
  hw.device.memory_bandwidth = roof.bandwidth;
  hw.device.memory_bytes = 1e18;
  hw.devices_per_node = std::max(world, 1);
  hw.intra_node = {roof.bandwidth / 2, 1e-6, plan::Topology::SharedMemory};
  hw.inter_node = hw.intra_node;
  hw.efficiency = {1.0, 0.0, 1.0, 1.0};
  return hw;
}

// The measured classes of the ranks the time model prices: those of pipeline stage `stage` (every rank
// without pipeline parallelism). Ranks are numbered with pp outermost (parallel/mesh_layout.h).
plan::MeasuredStep measured_step(const profile::StepReport& r, int world, int pp, int stage) {
  plan::MeasuredStep m;
  const int per_stage = world / std::max(pp, 1), first = stage * per_stage;
  int n = 0;
  for (const auto& k : r.analysis.ranks) {
    if (k.rank < first || k.rank >= first + per_stage) continue;
    ++n;
    m.step += k.step, m.gemm += k.gemm, m.other += k.compute - k.gemm;
    m.comm_exposed += k.comm_exposed, m.pipeline += k.pipeline_wait, m.host += k.host;
  }
  if (n == 0)
    throw ConfigError(fmt::format("the trace has no rank of pipeline stage {} (ranks {} to {})", stage, first,
                                  first + per_stage - 1));
  for (double* f : {&m.step, &m.gemm, &m.other, &m.comm_exposed, &m.pipeline, &m.host}) *f /= n;
  // Attention's share of the non-GEMM kernels' own time (every rank's), applied to their union.
  double attention = 0, kernels = 0;
  for (const auto& k : r.analysis.kernels) {
    if (k.category != profile::Category::Kernel) continue;
    kernels += k.seconds;
    if (k.name.rfind("attention", 0) == 0) attention += k.seconds;
  }
  if (kernels > 0) m.attention = m.other * attention / kernels, m.other -= m.attention;
  return m;
}

}  // namespace

plan::Layout layout_of(const train::RunConfig& cfg) {
  const auto& p = cfg.parallel;
  plan::Layout l;
  l.dp = static_cast<int>(p.dp), l.tp = static_cast<int>(p.tp), l.pp = static_cast<int>(p.pp);
  l.cp = static_cast<int>(p.cp), l.ep = static_cast<int>(p.ep);
  l.cp_all_to_all = spec::parse_cp_mode(p.cp_mode) == spec::CpMode::AllToAll;
  l.vpp = static_cast<int>(p.pipeline_virtual_stages);
  l.micro_batch = static_cast<int>(cfg.micro_batch());
  l.zero = static_cast<int>(p.zero);
  l.sp = p.sequence_parallel && p.tp > 1;
  l.schedule = plan::planner_schedule(spec::parse_schedule(p.pipeline_schedule));
  l.recompute = cfg.train.recompute;
  return l;
}

RunPrediction predict_run(const train::RunConfig& cfg, int world, const std::optional<plan::Hardware>& machine,
                          const profile::StepReport& report) {
  RunPrediction out;
  plan::Job job;
  job.model = plan::PlanModel{cfg.model.resolved, "the run's config"};
  if (machine) {
    out.hardware = "machine file (" + machine->source + ")";
    job.cluster.hw = rank_device(*machine, world, out.hardware);
  } else {
    job.cluster.hw = roofline_device(report.roof, world);
    out.hardware = "the report's roofline (no --machine: GEMMs at the peak, links at half the bandwidth; loom "
                   "calibrate measures them)";
  }
  job.cluster.devices = world;
  job.seq = cfg.seq_len();
  job.global_batch = cfg.train.batch_size;
  job.precision = cfg.precision == model::Precision::BF16 ? "bf16" : "f32";
  job.software = plan::software_profile("loom");
  job.software.bf16_weights_only = cfg.pure_bf16;
  job.software.dp_overlap = cfg.parallel.bucket_kb > 0;  // buckets reduce while backward runs
  job.software.dp_bucket_bytes = static_cast<double>(cfg.parallel.bucket_kb) * 1024;
  // A CPU machine whose cores the ranks share: the collectives run on those cores (measured:
  // BENCHMARKS.md, tensor parallelism's overlap; dp2's 17-23 ms and ZeRO-3's ~34 ms of exposed
  // communication in the local loop, which the overlapped model had hidden).
  job.software.comm_on_compute_cores = machine && machine->devices_per_node == 1 && world > 1;
  job.software.tp_overlap = cfg.parallel.tp_overlap;  // the time model hides TP collectives only under SP
  job.software.recompute = cfg.train.recompute;       // the run's own policy
  out.software = plan::describe(job.software);
  if (!cfg.parallel.pipeline_layers.empty())
    job.software.pipeline_layers = spec::parse_layer_counts(cfg.parallel.pipeline_layers, "parallel.pipeline.layers");
  const plan::Layout l = layout_of(cfg);
  out.layout = l.str();
  if (l.devices() != world) {
    out.refused = fmt::format("the trace has {} ranks but the run's layout {} needs {}", world, out.layout,
                              l.devices());
    return out;
  }
  try {
    plan::check_job(job);
    if (const auto v = plan::check_layout(l, job); !v.ok()) {
      out.refused = "the planner refuses the run's layout: " + v.why;
      return out;
    }
  } catch (const ConfigError& e) {
    out.refused = std::string("the planner cannot take the run's job: ") + e.what();
    return out;
  }
  const plan::StepTime predicted = plan::step_time(l, job);
  out.priced_stage = l.pp > 1 ? predicted.priced_stage : -1;
  out.check = plan::check_prediction(predicted, measured_step(report, world, l.pp, predicted.priced_stage),
                                     job.cluster.hw.device.attention_rate(job.precision != "f32") > 0 ||
                                         !job.cluster.hw.attention_table.empty());
  return out;
}

std::string format_run_prediction(const RunPrediction& p) {
  std::string out = fmt::format("\nplanner (software {}) for layout {} on {}", p.software, p.layout, p.hardware);
  out += p.priced_stage >= 0 ? fmt::format("; measured on the stage it prices, the slowest ({}):\n", p.priced_stage)
                             : std::string(":\n");
  if (!p.refused.empty()) return out + "  no prediction: " + p.refused + "\n";
  return out + plan::format_prediction_check(p.check);
}

nlohmann::json run_prediction_json(const RunPrediction& p) {
  nlohmann::json j{{"layout", p.layout}, {"hardware", p.hardware}, {"software", p.software}};
  if (p.priced_stage >= 0) j["priced_stage"] = p.priced_stage;
  if (!p.refused.empty()) {
    j["refused"] = p.refused;
    return j;
  }
  nlohmann::json classes = nlohmann::json::array();
  for (const auto& k : p.check.classes) {
    const double e = k.error();
    classes.push_back({{"class", k.name},
                       {"predicted_s", k.predicted},
                       {"measured_s", k.measured},
                       {"error", k.modelled && std::isfinite(e) ? nlohmann::json(e) : nlohmann::json(nullptr)},
                       {"counts", p.check.counts(k)},
                       {"term", k.term}});
  }
  j["classes"] = classes;
  j["worst_error"] = p.check.worst_error();
  if (p.check.most_wrong >= 0) j["most_wrong"] = p.check.classes[static_cast<size_t>(p.check.most_wrong)].name;
  return j;
}

}  // namespace loom::cli
