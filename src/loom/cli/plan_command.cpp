// `loom plan`: the planner's CLI -- search the layouts of a model on a cluster and print a ranked table
// (or JSON), walk through the best one (--explain), show what each hardware figure is worth
// (--sensitivity), or check the cost model against published results (--validate FILE).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/cli/commands.h"
#include "loom/error.h"
#include "loom/plan/hf_config.h"
#include "loom/plan/search.h"
#include "loom/plan/software_profile.h"
#include "loom/plan/validation.h"
#include "loom/spec/pipeline_stages.h"
#include "loom/train/run_config.h"

namespace loom::cli {

namespace {

struct PlanOptions {
  std::string model, cluster, precision = "bf16", engine, software, pipeline_layers, attention_kernel;
  std::vector<std::string> validate;
  double moe_imbalance = 1.0;
  int64_t seq = 0, global_batch = 0;
  std::vector<std::string> fix;
  int top = 10;
  bool explain = false, json = false, sensitivity = false, tp_overlap = false;
};

// configs/hardware next to the binary's source tree, the working directory, or LOOM_HARDWARE_DIR.
std::vector<std::string> hardware_dirs() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("LOOM_HARDWARE_DIR")) dirs.emplace_back(env);
  dirs.emplace_back("configs/hardware");
  if (const std::string exe = self_executable(); !exe.empty())
    dirs.push_back((std::filesystem::path(exe).parent_path().parent_path() / "configs/hardware").string());
  return dirs;
}

constexpr double GiB = double(1 << 30);

std::string breakdown(const plan::StepTime& t) {
  auto pct = [&](double x) { return 100 * x / t.total; };
  // As StepTime::bound() counts them: the attention core with compute.
  return fmt::format("{:4.0f}% {:4.0f}% {:4.0f}% {:4.0f}%", pct(t.compute + t.attention_in_compute()),
                     pct(t.memory_bound - t.attention_in_compute()), pct(t.comm_exposed), pct(t.bubble));
}

nlohmann::json to_json(const plan::Candidate& c, const plan::Job& j) {
  const auto& t = c.time;
  const auto& m = c.memory;
  nlohmann::json out = {{"layout", c.layout.str()},
          {"dp", c.layout.dp}, {"tp", c.layout.tp}, {"pp", c.layout.pp}, {"cp", c.layout.cp}, {"ep", c.layout.ep},
          {"vpp", c.layout.vpp}, {"micro_batch", c.layout.micro_batch}, {"zero", c.layout.zero}, {"sp", c.layout.sp},
          {"recompute", plan::recompute_name(c.layout.recompute)}, {"schedule", plan::schedule_name(c.layout.schedule)},
          {"memory_GiB", {{"total", m.total / GiB}, {"weights", m.weights / GiB}, {"grads", m.grads / GiB},
                          {"optimizer", m.optimizer / GiB}, {"activations", m.activations / GiB},
                          {"logits", m.logits / GiB}, {"comm_buffers", m.comm_buffers / GiB}, {"usable", m.usable / GiB}}},
          {"step_s", t.total}, {"tokens_per_s", plan::tokens_per_s(t, j)}, {"mfu", plan::mfu(t, j)},
          // memory_bound includes the attention core, as StepTime keeps it: not a term of its own.
          {"breakdown_s", {{"compute", t.compute}, {"memory_bound", t.memory_bound},
                           {"memory_bound_of_which_attention", t.attention},
                           {"comm_exposed", t.comm_exposed},
                           {"bubble", t.bubble}, {"recompute", t.recompute}, {"tp", t.tp}, {"cp", t.cp}, {"ep", t.ep},
                           {"pp", t.pp}, {"dp", t.dp}, {"zero", t.zero}, {"overlap_slowdown", t.overlap}}},
          {"bound", t.bound()}};
  // An uneven cut (--pipeline-layers, or the trimmed ends where pp does not divide the blocks).
  if (const auto cut = plan::pipeline_cut(c.layout, j); !cut.empty()) out["pipeline_layers"] = cut;
  return out;
}

void explain(const plan::Candidate& c, const plan::Job& j) {
  const auto& t = c.time;
  const auto& m = c.memory;
  const auto& cfg = j.model.cfg;
  fmt::print("\nbest layout: {} (schedule {}, recompute {})\n", c.layout.str(), plan::schedule_name(c.layout.schedule),
             plan::recompute_name(c.layout.recompute));
  const std::vector<int64_t> cut = plan::pipeline_cut(c.layout, j);
  std::string per_stage = fmt::format("{} layers per stage", cfg.n_layers / c.layout.pp);
  if (!cut.empty()) per_stage = fmt::format("blocks per pipeline chunk {}", fmt::join(cut, ","));
  // Loom's engine cuts its blocks by cost (spec::cut_pipeline), not n_layers / pp.
  if (cut.empty() && j.software.loom_engine && c.layout.pp > 1)
    per_stage = fmt::format("blocks per pipeline chunk {} (balanced by cost)",
                            spec::cut_pipeline(cfg, j.seq, c.layout.pp, c.layout.vpp).str());
  fmt::print("  micro-batches per step {} of {} sequences; {}\n", plan::micro_batches(c.layout, j), c.layout.micro_batch,
             per_stage);
  fmt::print("  memory/device {:.2f} GiB of {:.2f} usable ({:.0f}% margin kept): weights {:.2f}, grads {:.2f}, "
             "optimizer {:.2f}, activations {:.2f}, logits {:.2f}, comm buffers {:.2f}\n",
             m.total / GiB, m.usable / GiB, 100 * j.memory_margin, m.weights / GiB, m.grads / GiB, m.optimizer / GiB,
             m.activations / GiB, m.logits / GiB, m.comm_buffers / GiB);
  fmt::print("  step {:.3f} s = compute {:.3f} + attention core {:.3f} + memory-bound {:.3f} + exposed comm {:.3f} + bubble {:.3f}",
             t.total, t.compute, t.attention, t.memory_bound - t.attention, t.comm_exposed, t.bubble);
  if (t.overlap > 0)
    fmt::print(" + compute slowed under overlapped comm {:.3f} (efficiency.overlap_slowdown {:.3g})", t.overlap,
               j.cluster.hw.efficiency.overlap_slowdown);
  fmt::print("\n");
  fmt::print("  exposed comm: tp {:.3f}, cp {:.3f}, ep {:.3f}, pp {:.3f}, dp {:.3f}, zero {:.3f}; recompute {:.3f} s\n",
             t.tp, t.cp, t.ep, t.pp, t.dp, t.zero, t.recompute);
  fmt::print("  model FLOPs/step {:.3e}, executed {:.3e}; {:.0f} tokens/s, MFU {:.1f}% -> bound by {}\n", t.model_flops,
             t.hardware_flops, plan::tokens_per_s(t, j), 100 * plan::mfu(t, j), t.bound());
}

int run_validate(const PlanOptions& o) {
  auto rep = plan::validate_files(o.validate, hardware_dirs());
  if (o.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (auto& l : rep.lines)
      rows.push_back({{"row", l.row}, {"set", l.set}, {"hardware", l.hardware}, {"software", l.software}, {"metric", l.metric},
                      {"layout", l.layout}, {"published", l.published}, {"predicted", l.predicted}, {"error", l.error()},
                      {"constant", l.constant}, {"memory_note", l.memory_note}});
    nlohmann::json sets = nlohmann::json::object(), families = nlohmann::json::array();
    for (auto& [name, e] : rep.sets)
      sets[name] = {{"lines", e.lines}, {"mean_error", e.mean}, {"worst_error", e.worst},
                    {"constant_utilisation", e.constant_utilisation}, {"constant_mean_error", e.constant_mean},
                    {"constant_worst_error", e.constant_worst}, {"model_over_constant", e.ratio()}};
    for (auto& f : rep.families)
      families.push_back({{"hardware", f.hardware}, {"in_sample_lines", f.in_sample_lines}, {"held_out_lines", f.held_out_lines},
                          {"gemm_max", f.gemm_max}, {"in_sample_gemm_scale", f.scale},
                          {"in_sample_fitted_mean_error", f.in_sample_mean}});
    nlohmann::json profiles = nlohmann::json::array();
    for (auto& p : rep.profiles)
      profiles.push_back({{"software", p.software}, {"in_sample_lines", p.in_sample_rows},
                          {"no_recompute_slowdown", p.shipped}, {"in_sample_fit", p.fitted},
                          {"shipped_mean_error", p.shipped_mean}, {"fitted_mean_error", p.fitted_mean}});
    fmt::print("{}\n", nlohmann::json{{"rows", rows}, {"sets", sets}, {"families", families}, {"profiles", profiles},
                                      {"throughput_mean_error", rep.throughput_mean},
                                      {"throughput_worst_error", rep.throughput_worst},
                                      {"constant_utilisation", rep.constant_utilisation},
                                      {"constant_mean_error", rep.constant_mean},
                                      {"constant_worst_error", rep.constant_worst},
                                      {"constant_leave_one_out_mean_error", rep.constant_loo_mean},
                                      {"gemm_scale_fitted", rep.gemm_scale_fitted},
                                      {"gemm_fitted_mean_error", rep.gemm_fitted_mean},
                                      {"gemm_leave_one_out_mean_error", rep.gemm_loo_mean},
                                      {"speedup_worst_error", rep.speedup_worst}, {"memory_worst_error", rep.memory_worst}}
                                .dump(2));
    return 0;
  }
  const bool split = rep.sets.count("held-out") > 0;
  fmt::print("{:<21} {}{:<13} {:<14} {:<30} {:<34} {:>10} {:>10} {:>7} {:>10} {:>7}\n", "row", split ? "set       " : "",
             "hardware", "software", "metric", "layout (planner)", "published", "predicted", "error", "constant", "error");
  for (auto& l : rep.lines) {
    std::string cst = l.throughput ? fmt::format("{:>10.3g} {:>6.1f}%", l.constant, 100 * l.constant_error()) : "";
    fmt::print("{:<21} {}{:<13} {:<14} {:<30} {:<34} {:>10.4g} {:>10.4g} {:>6.1f}% {}\n", l.row,
               split ? fmt::format("{:<10}", l.set) : "", l.hardware, l.software, l.metric, l.layout, l.published,
               l.predicted, 100 * l.error(), cst);
    if (!l.memory_note.empty()) fmt::print("{:<21}   ^ the published layout ran, but {}\n", "", l.memory_note);
  }
  fmt::print("\nthroughput rows: mean error {:.1f}%, worst {:.1f}% (goal <= 10% / 20%)\n", 100 * rep.throughput_mean,
             100 * rep.throughput_worst);
  for (auto& [name, e] : rep.sets)
    fmt::print("  {:<9} {:>2} lines: mean {:.1f}%, worst {:.1f}%; best constant on these lines ({:.1f}% of bf16 peak): mean "
               "{:.1f}%, worst {:.1f}% -> model/constant = {:.2f}{}\n",
               name, e.lines, 100 * e.mean, 100 * e.worst, 100 * e.constant_utilisation, 100 * e.constant_mean,
               100 * e.constant_worst, e.ratio(), name == "held-out" ? " (goal: mean <= 10%, worst <= 20%, ratio <= 0.6)" : "");
  for (auto& f : rep.families)
    fmt::print("  {:<10} efficiency.gemm_max {:.3f}: {} in-sample / {} held-out lines; in-sample fit x{:.3f} (mean {:.1f}%)\n",
               f.hardware, f.gemm_max, f.in_sample_lines, f.held_out_lines, f.scale, 100 * f.in_sample_mean);
  for (auto& p : rep.profiles)
    fmt::print("  {:<13} no_recompute_slowdown {:.2f}: {} in-sample lines without full recompute, mean {:.1f}%; in-sample "
               "fit {:.2f} (mean {:.1f}%)\n",
               p.software, p.shipped, p.in_sample_rows, 100 * p.shipped_mean, p.fitted, 100 * p.fitted_mean);
  fmt::print("best constant predictor (hardware-FLOP utilisation {:.1f}%): mean {:.1f}%, worst {:.1f}% -> model/constant "
             "= {:.2f} (goal <= 0.5)\n",
             100 * rep.constant_utilisation, 100 * rep.constant_mean, 100 * rep.constant_worst,
             rep.throughput_mean / rep.constant_mean);
  fmt::print("one global GEMM efficiency fitted like the constant: x{:.3f} of the shipped value, mean {:.1f}%; leave one row "
             "out: model {:.1f}%, constant {:.1f}% -> {:.2f}\n",
             rep.gemm_scale_fitted, 100 * rep.gemm_fitted_mean, 100 * rep.gemm_loo_mean, 100 * rep.constant_loo_mean,
             rep.gemm_loo_mean / rep.constant_loo_mean);
  fmt::print("Table 5 full->selective speed-ups: worst error {:.1f}% (goal <= 5%); Figure 1 memory: worst error {:.1f}% "
             "(goal <= 10%)\n",
             100 * rep.speedup_worst, 100 * rep.memory_worst);
  return 0;
}

// --model: a zoo name or preset, or a model file -- Loom's [model] table in a TOML (any `loom train`
// config: the same keys, ranges and errors) or a Hugging Face config.json.
plan::PlanModel model_of(const std::string& name) {
  const std::filesystem::path path(name);
  const std::string ext = path.extension().string();
  if (ext != ".json" && ext != ".toml") return plan::plan_model(name);
  if (!std::filesystem::is_regular_file(path))
    throw ConfigError("--model " + name + ": no such file (a model file is a .toml with a [model] table, or a Hugging "
                      "Face config.json)");
  if (ext == ".json") return plan::load_hf_config(name);
  const auto cfg = train::load_run_config(name);
  return plan::PlanModel{cfg.model.resolved, "[model] of " + name};
}

int run_plan(const PlanOptions& o) {
  if (!o.validate.empty()) return run_validate(o);
  if (o.model.empty() || o.cluster.empty() || o.seq == 0 || o.global_batch == 0)
    throw ConfigError("loom plan needs --model, --cluster, --seq and --global-batch (or --validate FILE)");
  plan::Job job;
  job.model = model_of(o.model);
  job.cluster = plan::resolve_cluster(o.cluster, hardware_dirs());
  // bf16-pure computes as bf16 and holds its state in bf16 alone (no fp32 master).
  job.seq = o.seq, job.global_batch = o.global_batch, job.precision = o.precision == "bf16-pure" ? "bf16" : o.precision;
  job.model = job.model.at_sequence(job.seq);
  // --engine NAME is the older spelling of --software NAME.
  if (!o.engine.empty() && !o.software.empty() && o.engine != o.software)
    throw ConfigError("--engine " + o.engine + " and --software " + o.software + " disagree: give one (--engine is --software)");
  job.software = plan::software_profile(!o.software.empty() ? o.software : !o.engine.empty() ? o.engine : "megatron");
  job.software.bf16_weights_only = o.precision == "bf16-pure";
  job.software.moe_imbalance = o.moe_imbalance;
  if (o.tp_overlap) job.software.tp_overlap = true;
  if (!o.attention_kernel.empty()) {
    if (!job.software.flash_attention)
      throw ConfigError("--attention-kernel " + o.attention_kernel + ": the " + job.software.profile +
                        " profile materialises the attention scores (no flash kernel to choose)");
    try {
      plan::set_attention_kernel(job.software, o.attention_kernel);
    } catch (const ConfigError& e) {
      throw ConfigError("--attention-kernel " + std::string(e.what()));
    }
  }
  job.software.pipeline_layers = spec::parse_layer_counts(o.pipeline_layers, "--pipeline-layers");
  if (job.software.loom_engine && job.precision != "bf16")
    throw ConfigError("--software loom plans bf16 training (Loom's fp8 is an emulation of the numerics, not fp8 GEMMs); "
                      "drop --precision " + o.precision);
  plan::Fixed fixed;
  for (auto& f : o.fix) plan::apply_fix(fixed, f);
  auto r = plan::search(job, fixed, o.top);
  if (o.json) {
    nlohmann::json out{{"model", o.model}, {"cluster", job.cluster.hw.name}, {"devices", job.cluster.devices},
                       {"seq", o.seq}, {"global_batch", o.global_batch}, {"precision", o.precision}, {"tp_overlap", o.tp_overlap},
                       {"software", job.software.profile}, {"software_assumptions", plan::describe(job.software)},
                       {"evaluated", r.evaluated}, {"feasible", r.feasible}};
    for (auto& [reason, n] : r.rejected) out["rejected"][std::string(plan::reject_name(reason))] = n;
    out["warnings"] = r.warnings;
    for (auto& c : r.ranked) out["layouts"].push_back(to_json(c, job));
    if (o.sensitivity) {
      const auto rows = plan::sensitivity(job, fixed, r.ranked.front().layout);
      for (auto& s : rows)
        out["sensitivity"].push_back({{"figure", s.figure}, {"factor", s.factor}, {"step_s", s.same_layout},
                                      {"replanned_step_s", s.replanned}});
      const auto v = plan::sensitivity_verdict(rows, r.ranked.front().time.total);
      out["pays_most_if_twice_as_good"] = {{"figure", v.pays_most}, {"step_change", v.gain}};
      out["hurts_most_if_twice_as_bad"] = {{"figure", v.hurts_most},
                                     {"step_change", std::isinf(v.loss) ? nlohmann::json(nullptr) : nlohmann::json(v.loss)}};
    }
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  const auto params = plan::count_params(job.model);
  fmt::print("{} ({:.2f} B parameters) on {} x {} ({} per node), seq {}, global batch {}, {}\n", o.model,
             params.total * 1e-9, job.cluster.devices, job.cluster.hw.device.name, job.cluster.hw.devices_per_node, o.seq,
             o.global_batch, o.precision);
  fmt::print("software {}\n", plan::describe(job.software));
  for (const auto& w : r.warnings) fmt::print("warning: {}\n", w);
  fmt::print("{} layouts evaluated, {} feasible", r.evaluated, r.feasible);
  for (auto& [reason, n] : r.rejected) fmt::print("; {} {} (e.g. {})", n, plan::reject_name(reason), r.example[reason]);
  size_t width = 6;  // the layout column fits the longest layout listed
  for (auto& c : r.ranked) width = std::max(width, c.layout.str().size());
  fmt::print("\n\n{:>3} {:<{}} {:>9} {:>9} {:>11} {:>6}  {:<24} {}\n", "#", "layout", width, "mem GiB", "step s",
             "tokens/s", "MFU", "comp  mem  comm bubble", "bound");
  int i = 0;
  for (auto& c : r.ranked)
    fmt::print("{:>3} {:<{}} {:>9.2f} {:>9.3f} {:>11.0f} {:>5.1f}%  {:<24} {}\n", ++i, c.layout.str(), width,
               c.memory.total / GiB, c.time.total, plan::tokens_per_s(c.time, job), 100 * plan::mfu(c.time, job),
               breakdown(c.time), c.time.bound());
  if (o.explain) explain(r.ranked.front(), job);
  if (o.sensitivity) {
    const double base = r.ranked.front().time.total;
    fmt::print("\nsensitivity of {} (step {:.3f} s): step time when one figure changes\n", r.ranked.front().layout.str(), base);
    fmt::print("  {:<20} {:>6} {:>14} {:>16}\n", "figure", "x", "same layout", "re-planned");
    const auto rows = plan::sensitivity(job, fixed, r.ranked.front().layout);
    for (auto& s : rows) {
      auto cell = [&](double v) { return v > 0 ? fmt::format("{:.3f} s ({:+.0f}%)", v, 100 * (v / base - 1)) : std::string("does not fit"); };
      fmt::print("  {:<20} {:>6} {:>14} {:>16}\n", s.figure, s.factor, cell(s.same_layout), cell(s.replanned));
    }
    const auto v = plan::sensitivity_verdict(rows, base);
    if (v.pays_most.empty())
      fmt::print("  making no single figure twice as good shortens this step\n");
    else
      fmt::print("  pays most if twice as good: {} ({:+.0f}% step time, re-planned)\n", v.pays_most, 100 * v.gain);
    if (!v.hurts_most.empty())
      fmt::print("  hurts most if twice as bad: {} ({})\n", v.hurts_most,
                 std::isinf(v.loss) ? std::string("no layout fits") : fmt::format("{:+.0f}% step time, re-planned", 100 * v.loss));
  }
  return 0;
}

}  // namespace

void register_plan(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("plan", "Pick the fastest parallel layout for a model on a cluster (cost model)");
  auto o = std::make_shared<PlanOptions>();
  cmd->add_option("--model", o->model,
                  "model: a Loom preset or a zoo name (gpt3-175b, llama3-70b, mixtral-8x7b, ...), or a model file: "
                  "FILE.toml (Loom's [model] table, as loom train reads it) or a Hugging Face config.json (gpt2, llama, "
                  "mistral, mixtral)");
  cmd->add_option("--cluster", o->cluster, "NAME[:DEVICES] from configs/hardware (a100, h100, trn1, trn2) or FILE.toml[:DEVICES]");
  cmd->add_option("--seq", o->seq, "sequence length")->check(finite_range(1, 1 << 24));
  cmd->add_option("--global-batch", o->global_batch, "sequences per step")->check(finite_range(1, 1 << 24));
  cmd->add_option("--precision", o->precision,
                  "GEMM precision: bf16 | bf16-pure (bf16 weights and Adam moments, no fp32 master) | fp8")
      ->check(CLI::IsMember({"bf16", "bf16-pure", "fp8"}));
  cmd->add_option("--fix", o->fix, "pin a layout knob: dp= tp= pp= cp= cp_mode= ep= v= mb= zero= sp= recompute= schedule=");
  cmd->add_option("--top", o->top, "how many layouts to list")->check(finite_range(1, 100000));
  cmd->add_flag("--explain", o->explain, "walk through the best layout's numbers");
  cmd->add_flag("--json", o->json, "machine-readable output");
  cmd->add_flag("--sensitivity", o->sensitivity, "step time of the best layout with each hardware figure x2 and x0.5");
  cmd->add_option("--validate", o->validate,
                  "compare the cost model with published results in FILE (repeat it to validate several files as one set)");
  cmd->add_option("--pipeline-layers", o->pipeline_layers,
                  "blocks per pipeline chunk, e.g. \"7,8,8,...,7\" (first and last stages trimmed, as real runs cut "
                  "126 layers on 16 stages); only layouts with that many chunks are searched. Without it, a pp that "
                  "does not divide the blocks is cut that way by default (one chunk per stage)");
  cmd->add_option("--software", o->software,
                  "the training stack's assumptions, printed with every prediction: megatron (default: Megatron-Core "
                  "today), megatron-2021 (the published rows' Megatron-LM), nemo (Megatron-Core as NeMo runs it), deepspeed, pytorch-fsdp (Composer / llm-foundry, fms-fsdp, TorchTitan), neuron (NeuronX Distributed), "
                  "loom (Loom's own engine: its memory, exact to its measured peaks, and only the layouts it runs), or "
                  "FILE.toml with a [software] table (docs/planner.md)");
  cmd->add_option("--engine", o->engine, "the older spelling of --software: megatron or loom")
      ->check(CLI::IsMember({"megatron", "loom"}));
  cmd->add_option("--moe-imbalance", o->moe_imbalance,
                  "MoE: the busiest expert-parallel rank's routed tokens over the mean (default 1: uniform routing)")
      ->check(finite_range(1.0, 64.0));
  cmd->add_option("--attention-kernel", o->attention_kernel,
                  "the stack's flash attention: flash2 (FlashAttention-2 class, the default) or triton (the 2022 "
                  "Triton kernel llm-foundry's MPT runs: 1.8x slower)");
  cmd->add_flag("--tp-overlap", o->tp_overlap,
                "TP/SP collectives run under the GEMMs in chunks (Megatron-Core --tp-comm-overlap; needs sequence "
                "parallelism); default: exposed");
  cmd->callback([&action, o] { action = [o] { return run_plan(*o); }; });
}

}  // namespace loom::cli
