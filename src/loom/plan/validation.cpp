#include "loom/plan/validation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string_view>
#include <toml++/toml.h>

#include "loom/error.h"
#include "loom/plan/software_profile.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/search.h"

namespace loom::plan {

double ValidationLine::error() const {
  if (published == 0 || predicted == 0) return 0;
  // Time rows compare as throughput (1 / time), so a time error reads like a throughput error.
  return metric.find("(s)") != std::string::npos ? std::abs(published / predicted - 1) : std::abs(predicted / published - 1);
}
double ValidationLine::constant_error() const {
  if (!throughput || constant == 0) return 0;
  return metric.find("(s)") != std::string::npos ? std::abs(published / constant - 1) : std::abs(constant / published - 1);
}

namespace {

// Megatron-LM's FLOP conventions (reference file): 96 B s l h^2 (1 + s/6h + V/16lh) counts the recomputed
// forward; 72 B L s h^2 (1 + s/6h + V/12hL) counts model FLOPs only.
double flops96(const spec::TransformerConfig& c, double B, double s) {
  const double h = c.d_model, l = c.n_layers, V = c.vocab_size;
  return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
}
double flops72(const spec::TransformerConfig& c, double B, double s) {
  const double h = c.d_model, l = c.n_layers, V = c.vocab_size;
  return 72 * B * l * s * h * h * (1 + s / (6 * h) + V / (12 * h * l));
}

// The fastest layout with the row's fixed degrees; unstated micro-batch / virtual stages are searched
// over Megatron's schedules (1F1B, interleaved).
Candidate plan_row(const ValidationRow& r, Recompute rc, bool sp) {
  Fixed f = r.fixed;
  f.recompute = rc, f.sp = sp, f.zero = 0, f.cp = 1, f.ep = 1;
  std::optional<Candidate> best;
  for (Schedule s : {Schedule::OneFOneB, Schedule::Interleaved}) {
    if (r.fixed.pp.value_or(1) == 1 && s == Schedule::Interleaved) continue;
    Fixed g = f;
    g.schedule = s;
    if (s == Schedule::OneFOneB) {
      if (f.vpp && *f.vpp > 1) continue;
      g.vpp = 1;
    } else if (f.vpp && *f.vpp == 1) {
      continue;
    }
    try {
      Candidate c = search(r.job, g, 1).ranked.front();
      if (!best || c.time.total < best->time.total) best = c;
    } catch (const ConfigError&) {
    }
  }
  if (!best) throw ConfigError("validation row '" + r.name + "': no layout with its fixed degrees fits");
  return *best;
}

// A throughput line and what the constant-utilisation predictor needs for it: the FLOPs it charges per
// step, the devices and peak it divides them by, and `units` -- what the metric counts per step (TFLOPs,
// tokens; 0 for a time metric).
struct Throughput {
  size_t line;
  double hw_flops, devices, peak, units;
};

// The constant-utilisation predictor's value of a throughput line at utilisation u.
double constant_value(const ValidationLine& line, const Throughput& x, double u) {
  const double time = x.hw_flops / (u * x.devices * x.peak);
  return line.metric.find("(s)") != std::string::npos ? time : x.units / (time * x.devices);
}

// The row's own layout, as far as its source states it (degrees, recompute, ZeRO, cp, micro-batch,
// virtual stages); the planner picks the rest within the row's software profile. The published run
// ran, so a memory model that says its layout does not fit must not stop its time being predicted: the
// layout is then planned with the memory check lifted and `over_memory` set (reported beside the line).
constexpr double kMemoryLifted = 1024;  // device memory times this: no stated layout is refused for it

Candidate plan_row_as_stated(const ValidationRow& r, bool& over_memory) {
  over_memory = false;
  try {
    return search(r.job, r.fixed, 1).ranked.front();
  } catch (const ConfigError&) {
  }
  Job lifted = r.job;
  lifted.cluster.hw.device.memory_bytes *= kMemoryLifted;
  try {
    over_memory = true;
    return search(lifted, r.fixed, 1).ranked.front();
  } catch (const ConfigError& e) {
    throw ConfigError("validation row '" + r.name + "': no layout with its stated settings: " + e.what());
  }
}

// Every row's predictions with each row's GEMM efficiency (`efficiency.gemm_max`) multiplied by
// `gemm_scale`; the throughput lines are listed in `thr`.
void evaluate(const std::vector<ValidationRow>& rows, double gemm_scale, ValidationReport& rep,
              std::vector<Throughput>& thr) {
  for (const auto& row : rows) {
    ValidationRow r = row;
    r.job.cluster.hw.efficiency.gemm_max *= gemm_scale;
    const int devices = r.devices, tp = r.tp, pp = r.pp;
    const auto& c = r.job.model.cfg;
    const double B = static_cast<double>(r.job.global_batch), s = static_cast<double>(r.job.seq);
    const double peak = r.job.cluster.hw.peak(r.job.precision);

    if (auto pub = r.tflops_96) {
      Candidate k = plan_row(r, Recompute::Full, false);
      double pred = flops96(c, B, s) / (k.time.total * devices) * 1e-12;
      rep.lines.push_back({r.name, "TFLOP/s per GPU (96*)", k.layout.str(), *pub, pred, 0, true});
      thr.push_back({rep.lines.size() - 1, flops96(c, B, s), double(devices), peak, flops96(c, B, s) * 1e-12});
    }
    double full = 0, sel = 0;
    if (auto pub = r.iteration_full_s) {
      Candidate k = plan_row(r, Recompute::Full, false);
      full = k.time.total;
      rep.lines.push_back({r.name, "iteration, full recompute (s)", k.layout.str(), *pub, full, 0, true});
      thr.push_back({rep.lines.size() - 1, flops96(c, B, s), double(devices), peak, 0});
    }
    if (auto pub = r.iteration_selective_s) {
      Candidate k = plan_row(r, Recompute::Selective, true);
      sel = k.time.total;
      rep.lines.push_back({r.name, "iteration, selective + SP (s)", k.layout.str(), *pub, sel, 0, true});
      const double attn_recompute = 4 * B * s * s * c.d_model * c.n_layers;
      thr.push_back({rep.lines.size() - 1, flops72(c, B, s) + attn_recompute, double(devices), peak, 0});
      if (auto mfu = r.mfu)
        rep.lines.push_back({r.name, "MFU (72*)", k.layout.str(), *mfu, flops72(c, B, s) / (sel * devices * peak), 0, false});
    }
    if (auto pub = r.tokens_per_s_per_device) {
      // The constant is model-FLOP utilisation of the bf16 peak, fp8 rows included: the convention of
      // the vendors' own tables, and the stronger baseline (fp8 runs are far from twice as fast).
      bool over_memory = false;
      Candidate k = plan_row_as_stated(r, over_memory);
      const double tokens = B * s;
      rep.lines.push_back({r.name, "tokens/s per device", k.layout.str(), *pub, tokens / (k.time.total * devices), 0, true});
      if (over_memory) {
        rep.lines.back().memory_note =
            fmt::format("memory model: {:.1f} of {:.1f} GiB usable", k.memory.total / double(1 << 30),
                        k.memory.usable / kMemoryLifted / double(1 << 30));
        rep.over_memory.push_back(r.name);
      }
      thr.push_back({rep.lines.size() - 1, tokens * flops_per_token(r.job.model, r.job.seq), double(devices),
                     r.job.cluster.hw.peak("bf16"), tokens});
    }
    if (full > 0 && sel > 0) {
      double pub = *r.iteration_full_s / *r.iteration_selective_s;
      rep.lines.push_back({r.name, "speed-up full -> selective+SP", "", pub, full / sel, 0, false});
      rep.speedup_worst = std::max(rep.speedup_worst, rep.lines.back().error());
    }
    // Figure 1: first-stage memory with the row's stated micro-batch and virtual stages.
    auto mem_layout = [&](Recompute rc, bool sp) {
      Layout l{.dp = devices / (tp * pp), .tp = tp, .pp = pp, .vpp = r.fixed.vpp.value_or(1),
               .micro_batch = r.fixed.micro_batch.value_or(1), .sp = sp, .recompute = rc,
               .schedule = r.fixed.vpp.value_or(1) > 1 ? Schedule::Interleaved : Schedule::OneFOneB};
      return l;
    };
    const double GiB = double(1 << 30);
    auto activations = [&](const Layout& l) {
      return stage_layers(l, r.job, 0) * activation_bytes_per_layer(l, r.job) * in_flight_micro_batches(l, r.job);
    };
    if (auto pub = r.state_GiB) {
      Layout l = mem_layout(Recompute::Selective, true);
      StageParams p = stage_params(l, r.job, false);
      StateBytes sb;
      double pred = (p.dense + p.expert) * (sb.weight + sb.grad + sb.optimizer) / GiB;
      rep.lines.push_back({r.name, "weights + grads + optimizer (GiB)", l.str(), *pub, pred, 0, false});
      rep.memory_worst = std::max(rep.memory_worst, rep.lines.back().error());
    }
    if (auto pub = r.activations_none_GiB) {
      Layout l = mem_layout(Recompute::None, false);
      rep.lines.push_back({r.name, "activations, no recompute (GiB)", l.str(), *pub, activations(l) / GiB, 0, false});
      rep.memory_worst = std::max(rep.memory_worst, rep.lines.back().error());
    }
    if (auto pub = r.activations_selective_GiB) {
      Layout l = mem_layout(Recompute::Selective, true);
      rep.lines.push_back({r.name, "activations, selective + SP (GiB)", l.str(), *pub, activations(l) / GiB, 0, false});
      rep.memory_worst = std::max(rep.memory_worst, rep.lines.back().error());
    }
  }
}

// Reads a row's keys, naming the file, the row and the key in every error. Counts are integers in
// [1, kMaxCount]: degrees are cast to int and the planner multiplies batch, sequence and degrees in
// int64, which must not overflow; 2^24 is far beyond any published run.
constexpr int64_t kMaxCount = int64_t{1} << 24;
struct RowReader {
  const toml::table& t;
  const std::string& origin;
  const std::string& row;

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw ConfigError(fmt::format("{}: validation row '{}': '{}' {}", origin, row, key, problem));
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    const toml::node* n = t.get(key);
    if (!n) return fallback;
    if (auto v = n->value_exact<std::string>()) return *v;
    fail(key, "must be a string");
  }
  int64_t integer(const std::string& key, int64_t max) const {
    const toml::node* n = t.get(key);
    if (!n) fail(key, "is missing (a positive integer)");
    auto v = n->value_exact<int64_t>();
    if (!v || *v < 1 || *v > max) fail(key, fmt::format("must be an integer in [1, {}]", max));
    return *v;
  }
  // A published figure: absent, or a positive finite number.
  std::optional<double> figure(const std::string& key) const {
    const toml::node* n = t.get(key);
    if (!n) return std::nullopt;
    auto v = n->value<double>();
    if (!v || !std::isfinite(*v) || *v <= 0) fail(key, "must be a positive number");
    return v;
  }
};

// One fitted global parameter, in sample and left out: `errors[k][i]` is row i's error with the k-th
// value of the parameter. In sample: the k with the least mean error; leave-one-out: each row predicted
// with the k that fits the other rows best.
struct OneParameterFit {
  size_t best = 0;
  double mean = 0, loo_mean = 0;
};
OneParameterFit fit_one_parameter(const std::vector<std::vector<double>>& errors) {
  OneParameterFit f;
  if (errors.empty() || errors.front().empty()) return f;
  const size_t n = errors.front().size();
  std::vector<double> sums(errors.size(), 0);
  for (size_t k = 0; k < errors.size(); ++k)
    for (double e : errors[k]) sums[k] += e;
  f.best = static_cast<size_t>(std::min_element(sums.begin(), sums.end()) - sums.begin());
  f.mean = sums[f.best] / n;
  for (size_t i = 0; i < n; ++i) {
    size_t best_k = 0;
    for (size_t k = 1; k < errors.size(); ++k)
      if (sums[k] - errors[k][i] < sums[best_k] - errors[best_k][i]) best_k = k;
    f.loo_mean += errors[best_k][i] / n;
  }
  return f;
}

}  // namespace

std::vector<ValidationRow> parse_validation(const std::string& text, const std::string& origin,
                                            const std::vector<std::string>& dirs) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}: line {}: {}", origin, e.source().begin.line, e.description()));
  }
  auto* rows = root["row"].as_array();
  if (!rows || rows->empty()) throw ConfigError(origin + ": no [[row]] entries");
  std::vector<ValidationRow> parsed;
  for (auto& node : *rows) {
    auto* t = node.as_table();
    if (!t) throw ConfigError(origin + ": [[row]] must be a table");
    ValidationRow r;
    r.name = t->at_path("name").value_or(std::string("?"));
    const RowReader in{*t, origin, r.name};
    try {
      r.job.model = plan_model(in.string("model", "?"));
      r.devices = static_cast<int>(in.integer("devices", kMaxCount));
      r.job.cluster = resolve_cluster(in.string("hardware", "?") + ":" + std::to_string(r.devices), dirs);
    } catch (const ConfigError& e) {
      if (std::string_view(e.what()).starts_with(origin)) throw;
      throw ConfigError(fmt::format("{}: validation row '{}': {}", origin, r.name, e.what()));  // unknown model, hardware
    }
    r.job.seq = in.integer("seq", kMaxCount);
    r.job.model = r.job.model.at_sequence(r.job.seq);
    // A published run fit its devices, so the planner's safety margin (10%, for plans not yet run)
    // would only push unstated knobs (recompute) to costlier choices than the run made. Kept: 5% for
    // the runtime (CUDA / Neuron context, communicator buffers).
    r.job.memory_margin = 0.05;
    r.job.global_batch = in.integer("global_batch", kMaxCount);
    // The row's software profile (plan/software_profile.h); rows of the 2021-22 papers run
    // "megatron-2021": materialised attention scores, dropout, no TP overlap, and its "local" DDP
    // all-reducing the fp32 gradient buffer after the last micro-batch (not overlapped). `ddp = "torch"`
    // (PyTorch DDP, SC21's pp = 1 runs) reduces the 16-bit gradients in buckets during backward.
    try {
      r.job.software = software_profile(in.string("software", "megatron"));
    } catch (const ConfigError& e) {
      in.fail("software", std::string(": ") + e.what());
    }
    if (t->contains("ddp")) {
      const std::string ddp = in.string("ddp", "local");
      if (ddp == "torch")
        r.job.software.dp_overlap = true, r.job.software.grad_bytes = 2;
      else if (ddp == "local")
        r.job.software.dp_overlap = false, r.job.software.grad_bytes = 4;
      else
        in.fail("ddp", "= \"" + ddp + "\" is not \"local\" or \"torch\"");
    }
    if (t->contains("attention_kernel")) {
      try {
        set_attention_kernel(r.job.software, in.string("attention_kernel", "flash2"));
      } catch (const ConfigError& e) {
        in.fail("attention_kernel", std::string("= ") + e.what());
      }
      if (!r.job.software.flash_attention && r.job.software.attention_kernel != "flash2")
        in.fail("attention_kernel", "names a flash-attention kernel, but the row's software materialises the scores");
    }
    r.set = in.string("set", "in-sample");
    if (r.set != "in-sample" && r.set != "held-out") in.fail("set", "= \"" + r.set + "\" is not \"in-sample\" or \"held-out\"");
    r.source = in.string("source", "");
    r.job.precision = in.string("precision", "bf16");
    if (r.job.precision != "bf16" && r.job.precision != "fp8")
      in.fail("precision", "= \"" + r.job.precision + "\" is not \"bf16\" or \"fp8\"");
    r.tp = static_cast<int>(in.integer("tp", kMaxCount));
    r.pp = static_cast<int>(in.integer("pp", kMaxCount));
    const int cp = t->contains("cp") ? static_cast<int>(in.integer("cp", kMaxCount)) : 1;
    const int64_t tp_pp = int64_t{r.tp} * r.pp * cp;
    if (r.devices % tp_pp != 0)
      throw ConfigError(fmt::format("{}: validation row '{}': tp * pp * cp = {} does not divide devices = {}", origin,
                                    r.name, tp_pp, r.devices));
    r.fixed.tp = r.tp, r.fixed.pp = r.pp, r.fixed.dp = static_cast<int>(r.devices / tp_pp);
    r.fixed.cp = cp, r.fixed.ep = 1;
    if (t->contains("zero")) {
      const auto z = t->get("zero")->value_exact<int64_t>();
      if (!z || *z < 0 || *z > 3) in.fail("zero", "must be 0, 1, 2 or 3");
      r.fixed.zero = static_cast<int>(*z);
    }
    if (t->contains("recompute")) {
      const std::string rc = in.string("recompute", "");
      if (rc != "none" && rc != "selective" && rc != "full")
        in.fail("recompute", "= \"" + rc + "\" is not \"none\", \"selective\" or \"full\"");
      r.fixed.recompute = spec::parse_recompute(rc);
    }
    if (t->contains("micro_batch")) r.fixed.micro_batch = static_cast<int>(in.integer("micro_batch", kMaxCount));
    if (t->contains("vpp")) r.fixed.vpp = static_cast<int>(in.integer("vpp", kMaxCount));
    r.tflops_96 = in.figure("tflops_96");
    r.iteration_full_s = in.figure("iteration_full_s");
    r.iteration_selective_s = in.figure("iteration_selective_s");
    r.mfu = in.figure("mfu");
    r.state_GiB = in.figure("state_GiB");
    r.activations_none_GiB = in.figure("activations_none_GiB");
    r.activations_selective_GiB = in.figure("activations_selective_GiB");
    r.tokens_per_s_per_device = in.figure("tokens_per_s_per_device");
    if (auto seqs = in.figure("sequences_per_s")) {
      if (r.tokens_per_s_per_device) in.fail("sequences_per_s", "and 'tokens_per_s_per_device' state the same figure: give one");
      r.tokens_per_s_per_device = *seqs * static_cast<double>(r.job.seq) / r.devices;
    }
    if (r.tokens_per_s_per_device && (r.tflops_96 || r.iteration_full_s || r.iteration_selective_s))
      in.fail("tokens_per_s_per_device", "cannot share a row with the Megatron-paper figures (tflops_96, iteration_*_s)");
    for (const auto& [key, value] : *t) {
      static const char* const known[] = {"name", "model", "hardware", "devices", "seq", "global_batch", "software", "ddp", "attention_kernel",
                                          "set", "source", "precision", "tp", "pp", "cp", "zero", "recompute",
                                          "micro_batch", "vpp", "tflops_96", "iteration_full_s", "iteration_selective_s",
                                          "mfu", "state_GiB", "activations_none_GiB", "activations_selective_GiB",
                                          "tokens_per_s_per_device", "sequences_per_s"};
      if (std::find(std::begin(known), std::end(known), key.str()) == std::end(known))
        in.fail(std::string(key.str()), "is not a validation row key");
    }
    parsed.push_back(std::move(r));
  }
  return parsed;
}

ValidationReport validate(const std::string& text, const std::string& origin, const std::vector<std::string>& dirs) {
  return validate(parse_validation(text, origin, dirs));
}

namespace {

// Model and best-constant errors over the throughput lines `subset` (indices into `thr`), the constant's
// utilisation fitted to those lines alone.
SetErrors set_errors(const ValidationReport& rep, const std::vector<Throughput>& thr, const std::vector<size_t>& subset) {
  SetErrors e;
  e.lines = static_cast<int>(subset.size());
  if (subset.empty()) return e;
  std::vector<double> utilisations;
  std::vector<std::vector<double>> errors;
  for (double u = 0.10; u <= 0.90; u += 0.0005) {
    utilisations.push_back(u);
    auto& errs = errors.emplace_back();
    for (size_t i : subset) {
      ValidationLine l = rep.lines[thr[i].line];
      l.constant = constant_value(l, thr[i], u);
      errs.push_back(l.constant_error());
    }
  }
  const OneParameterFit fit = fit_one_parameter(errors);
  e.constant_utilisation = utilisations[fit.best];
  e.constant_loo_mean = fit.loo_mean;
  for (size_t k = 0; k < subset.size(); ++k) {
    const auto& l = rep.lines[thr[subset[k]].line];
    e.mean += l.error() / static_cast<double>(subset.size());
    e.worst = std::max(e.worst, l.error());
    e.constant_mean += errors[fit.best][k] / static_cast<double>(subset.size());
    e.constant_worst = std::max(e.constant_worst, errors[fit.best][k]);
  }
  return e;
}

// Every throughput line's error with each of `scales` applied to the GEMM efficiency of `rows`.
std::vector<std::vector<double>> errors_by_gemm_scale(const std::vector<ValidationRow>& rows, const std::vector<double>& scales) {
  std::vector<std::vector<double>> out;
  for (double k : scales) {
    ValidationReport scratch;
    std::vector<Throughput> scratch_thr;
    evaluate(rows, k, scratch, scratch_thr);
    auto& errs = out.emplace_back();
    for (auto& x : scratch_thr) errs.push_back(scratch.lines[x.line].error());
  }
  return out;
}

std::vector<double> scale_grid(double lo, double hi) {
  std::vector<double> g;
  for (double k = lo; k <= hi + 1e-9; k += 0.005) g.push_back(k);
  return g;
}

}  // namespace

ValidationReport validate(const std::vector<ValidationRow>& parsed) {
  ValidationReport rep;
  std::vector<Throughput> thr;
  evaluate(parsed, 1.0, rep, thr);
  for (auto& line : rep.lines)
    for (const auto& r : parsed)
      if (r.name == line.row) line.software = r.job.software.profile, line.set = r.set, line.hardware = r.job.cluster.hw.name;

  // The bar to beat: one hardware-FLOP utilisation u for all throughput rows (time = FLOPs / (u N peak)),
  // u chosen to minimise the mean relative throughput error.
  std::vector<size_t> all(thr.size());
  for (size_t i = 0; i < thr.size(); ++i) all[i] = i;
  const SetErrors every = set_errors(rep, thr, all);
  rep.constant_utilisation = every.constant_utilisation;
  rep.throughput_mean = every.mean, rep.throughput_worst = every.worst;
  rep.constant_mean = every.constant_mean, rep.constant_worst = every.constant_worst;
  rep.constant_loo_mean = every.constant_loo_mean;
  for (auto& x : thr) rep.lines[x.line].constant = constant_value(rep.lines[x.line], x, rep.constant_utilisation);
  for (const char* set : {"in-sample", "held-out"}) {
    std::vector<size_t> subset;
    for (size_t i = 0; i < thr.size(); ++i)
      if (rep.lines[thr[i].line].set == set) subset.push_back(i);
    if (!subset.empty()) rep.sets[set] = set_errors(rep, thr, subset);
  }

  // The model's counterpart of the constant's one fitted number: the GEMM efficiency, one scale for
  // every row, fitted the same way. A model whose shipped constants are right fits a scale near 1; its
  // leave-one-out error says how well it predicts a row it was not fitted to.
  const std::vector<double> scales = scale_grid(0.80, 1.10);
  const OneParameterFit mfit = fit_one_parameter(errors_by_gemm_scale(parsed, scales));
  rep.gemm_scale_fitted = scales[mfit.best];
  rep.gemm_fitted_mean = mfit.mean;
  rep.gemm_loo_mean = mfit.loo_mean;

  // Per device family, the GEMM efficiency its in-sample rows alone call for: what its hardware file
  // should ship. Held-out rows never enter this fit.
  std::vector<std::string> names;
  for (const auto& r : parsed)
    if (std::find(names.begin(), names.end(), r.job.cluster.hw.name) == names.end()) names.push_back(r.job.cluster.hw.name);
  for (const auto& name : names) {
    FamilyFit f;
    f.hardware = name;
    std::vector<ValidationRow> fit_rows;
    for (const auto& r : parsed) {
      if (r.job.cluster.hw.name != name) continue;
      f.gemm_max = r.job.cluster.hw.efficiency.gemm_max;
      if (r.set == "in-sample") fit_rows.push_back(r);
    }
    for (const auto& l : rep.lines)
      if (l.throughput && l.hardware == name) (l.set == "in-sample" ? f.in_sample_lines : f.held_out_lines)++;
    if (f.in_sample_lines > 0) {
      // Coarse (0.02) over 0.5 .. 1.3, then the 0.005 grid around the best: every row is planned at
      // every scale tried, so the full fine grid would cost three times as much.
      std::vector<double> coarse;
      for (double k = 0.50; k <= 1.30 + 1e-9; k += 0.02) coarse.push_back(k);
      const double around = coarse[fit_one_parameter(errors_by_gemm_scale(fit_rows, coarse)).best];
      const std::vector<double> grid = scale_grid(around - 0.02, around + 0.02);
      const OneParameterFit ff = fit_one_parameter(errors_by_gemm_scale(fit_rows, grid));
      f.scale = grid[ff.best], f.in_sample_mean = ff.mean;
    }
    rep.families.push_back(f);
  }

  // Per software profile, the no-recompute slowdown its in-sample rows alone call for (0 .. 0.4 by
  // 0.01). Held-out rows never enter this fit either.
  std::vector<std::string> profiles;
  for (const auto& r : parsed)
    if (r.set == "in-sample" && std::find(profiles.begin(), profiles.end(), r.job.software.profile) == profiles.end())
      profiles.push_back(r.job.software.profile);
  for (const auto& name : profiles) {
    std::vector<ValidationRow> rows;
    for (const auto& r : parsed)
      if (r.set == "in-sample" && r.job.software.profile == name) rows.push_back(r);
    std::vector<double> grid;
    for (int k = 0; k <= 40; ++k) grid.push_back(0.01 * k);
    std::vector<std::vector<double>> errors;
    for (double x : grid) {
      for (auto& r : rows) r.job.software.no_recompute_slowdown = x;
      errors.push_back(errors_by_gemm_scale(rows, {1.0}).front());
    }
    // Only the lines the knob moves (those without full recompute) fit it and are counted.
    std::vector<size_t> moved;
    for (size_t i = 0; i < errors.front().size(); ++i)
      if (errors.front()[i] != errors.back()[i]) moved.push_back(i);
    if (moved.empty()) continue;
    auto only_moved = [&](const std::vector<double>& e) {
      std::vector<double> out;
      for (size_t i : moved) out.push_back(e[i]);
      return out;
    };
    for (auto& e : errors) e = only_moved(e);
    ProfileFit p;
    p.software = name, p.in_sample_rows = static_cast<int>(moved.size());
    for (const auto& r : parsed)
      if (r.job.software.profile == name) p.shipped = r.job.software.no_recompute_slowdown;
    const OneParameterFit f = fit_one_parameter(errors);
    p.fitted = grid[f.best], p.fitted_mean = f.mean;
    for (auto& r : rows) r.job.software.no_recompute_slowdown = p.shipped;
    for (double e : only_moved(errors_by_gemm_scale(rows, {1.0}).front())) p.shipped_mean += e / p.in_sample_rows;
    rep.profiles.push_back(p);
  }
  return rep;
}

ValidationReport validate_file(const std::string& path, const std::vector<std::string>& dirs) {
  return validate_files({path}, dirs);
}

ValidationReport validate_files(const std::vector<std::string>& paths, const std::vector<std::string>& dirs) {
  std::vector<ValidationRow> rows;
  for (const auto& path : paths) {
    std::ifstream in(path);
    if (!in) throw ConfigError("cannot read validation file '" + path + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    for (auto& r : parse_validation(ss.str(), path, dirs)) {
      for (const auto& o : rows)
        if (o.name == r.name) throw ConfigError(path + ": validation row '" + r.name + "' is named twice; row names must be unique");
      rows.push_back(std::move(r));
    }
  }
  return validate(rows);
}

}  // namespace loom::plan
