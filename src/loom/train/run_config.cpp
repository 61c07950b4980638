#include "loom/train/run_config.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <sstream>
#include <toml++/toml.h>

#include "loom/core/toml_text.h"
#include "loom/error.h"
#include "loom/spec/pipeline_schedule.h"
#include "loom/spec/pipeline_stages.h"
#include "loom/spec/checked_size.h"
#include "loom/spec/context_parallel.h"

namespace loom::train {

namespace {

// ---- typed readers that name the key and the offending value ----
std::string describe(const toml::node& n) {
  std::ostringstream s;
  n.visit([&](auto&& v) { s << v; });
  std::ostringstream t;
  t << n.type();
  return t.str() + " " + s.str();
}
int64_t as_int(const toml::node& n, const std::string& key) {
  if (auto v = n.value_exact<int64_t>()) return *v;
  throw ConfigError(key + " must be an integer, got " + describe(n));
}
double as_double(const toml::node& n, const std::string& key) {
  if (auto v = n.value<double>()) return *v;
  throw ConfigError(key + " must be a number, got " + describe(n));
}
bool as_bool(const toml::node& n, const std::string& key) {
  if (auto v = n.value_exact<bool>()) return *v;
  throw ConfigError(key + " must be true or false, got " + describe(n));
}
std::string as_string(const toml::node& n, const std::string& key) {
  if (auto v = n.value_exact<std::string>()) return *v;
  throw ConfigError(key + " must be a string, got " + describe(n));
}
// A TOML basic string: "..." with backslashes, quotes and control characters escaped.
std::string quote(const std::string& s) { return toml_basic_string(s); }
// Shortest text that reads back to the same value; always a TOML float.
template <typename T>
std::string num(T v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".e") == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
  return s;
}

// The values a numeric key accepts. Every number is also finite (TOML's inf and nan are refused).
struct Range {
  double lo, hi;
  bool lo_open = false, hi_open = false;  // (lo, ...] / [..., hi)
  std::string str(bool integer) const {
    auto n = [&](double v) {
      if (!integer) return fmt::format("{}", v);
      if (v >= 9.2e18) return std::string("2^63-1");
      const auto i = static_cast<int64_t>(v);
      if (i >= (1 << 20) && (i & (i - 1)) == 0) return fmt::format("2^{}", __builtin_ctzll(static_cast<uint64_t>(i)));
      return fmt::format("{}", i);
    };
    return fmt::format("{}{}, {}{}", lo_open ? "(" : "[", n(lo), n(hi), hi_open ? ")" : "]");
  }
  bool contains(double v) const {
    return std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
};

// Bounds chosen so that no size computed from them overflows before the cross-key checks run, and
// wide enough for any real run (the largest published runs use ~126 layers, widths of 2^14-2^15,
// vocabularies of ~2^18 and contexts of 2^17-2^20).
constexpr double kMaxCount = 1099511627776.0;  // 2^40: steps, intervals
constexpr double kMaxWidth = 16777216.0;       // 2^24: widths, sequence lengths, batch sizes

struct Field {
  std::string key;
  std::string type;
  std::string doc;
  std::function<void(RunConfig&, const toml::node&)> set;
  std::function<std::string(const RunConfig&)> get;  // a TOML literal
  std::optional<Range> range;                         // numeric keys
};

int64_t ranged_int(const toml::node& n, const std::string& key, const Range& r) {
  const int64_t v = as_int(n, key);
  if (!r.contains(static_cast<double>(v)))
    throw ConfigError(fmt::format("{} = {} is out of range: it must be in {}", key, v, r.str(true)));
  return v;
}
double ranged_double(const toml::node& n, const std::string& key, const Range& r) {
  const double v = as_double(n, key);
  if (!r.contains(v)) throw ConfigError(fmt::format("{} = {} is out of range: it must be a finite number in {}", key, v, r.str(false)));
  return v;
}

#define LOOM_INT(KEY, MEMBER, LO, HI, DOC)                                                                        \
  Field{KEY, "integer", DOC,                                                                                      \
        [](RunConfig& c, const toml::node& n) {                                                                   \
          c.MEMBER = static_cast<decltype(c.MEMBER)>(ranged_int(n, KEY, Range{LO, HI}));                          \
        },                                                                                                        \
        [](const RunConfig& c) { return std::to_string(c.MEMBER); }, Range{LO, HI}}
// RANGE: a braced Range, e.g. (Range{0, 1, false, true}) for [0, 1).
#define LOOM_DOUBLE(KEY, MEMBER, RANGE, DOC)                                                                      \
  Field{KEY, "number", DOC,                                                                                       \
        [](RunConfig& c, const toml::node& n) {                                                                   \
          c.MEMBER = static_cast<decltype(c.MEMBER)>(ranged_double(n, KEY, Range RANGE));                         \
        },                                                                                                        \
        [](const RunConfig& c) { return num(c.MEMBER); }, Range RANGE}
#define LOOM_BOOL(KEY, MEMBER, DOC) \
  Field{KEY, "bool", DOC, [](RunConfig& c, const toml::node& n) { c.MEMBER = as_bool(n, KEY); }, \
        [](const RunConfig& c) { return std::string(c.MEMBER ? "true" : "false"); }}
#define LOOM_STRING(KEY, MEMBER, DOC) \
  Field{KEY, "string", DOC, [](RunConfig& c, const toml::node& n) { c.MEMBER = as_string(n, KEY); }, \
        [](const RunConfig& c) { return quote(c.MEMBER); }}

// The one place each configuration key is defined and documented.
const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      LOOM_STRING("model.preset", model.preset, "model preset: tiny, tiny-llama, tiny-moe, mini, gpt2-124m, llama-mini, moe-mini"),
      Field{"model.arch", "string", "architecture family: \"gpt2\" or \"llama\" (overrides the preset's)",
            [](RunConfig& c, const toml::node& n) { c.model.resolved.arch = spec::parse_arch(as_string(n, "model.arch")); },
            [](const RunConfig& c) { return quote(std::string(spec::arch_name(c.model.resolved.arch))); }},
      // Token ids are 32-bit.
      LOOM_INT("model.vocab_size", model.resolved.vocab_size, 1, 2147483647.0, "vocabulary size V"),
      LOOM_INT("model.max_seq", model.resolved.max_seq, 1, kMaxWidth, "context length the model is built for"),
      LOOM_INT("model.d_model", model.resolved.d_model, 1, kMaxWidth, "residual width C"),
      LOOM_INT("model.n_layers", model.resolved.n_layers, 1, 65536, "number of transformer blocks L"),
      LOOM_INT("model.n_heads", model.resolved.n_heads, 1, 65536, "attention heads H (must divide d_model)"),
      LOOM_INT("model.n_kv_heads", model.resolved.n_kv_heads, 1, 65536, "key/value heads (GQA, llama only; must divide n_heads)"),
      LOOM_INT("model.d_ff", model.resolved.d_ff, 1, kMaxWidth, "MLP hidden width (SwiGLU: width of gate and of up)"),
      LOOM_DOUBLE("model.norm_eps", model.resolved.norm_eps, ({0, 1, true}), "epsilon of LayerNorm / RMSNorm"),
      LOOM_DOUBLE("model.rope_theta", model.resolved.rope_theta, ({0, 1e12, true}), "rotary embedding base (llama)"),
      LOOM_BOOL("model.tie_embeddings", model.resolved.tie_embeddings, "LM head shares the token embedding"),
      LOOM_DOUBLE("model.init_std", model.resolved.init_std, ({0, 10, true}), "standard deviation of the normal initialisation"),
      LOOM_INT("model.moe.experts", model.resolved.moe.experts, 0, 65536,
               "mixture of experts: routed SwiGLU experts per MoE block (0: a dense model)"),
      LOOM_INT("model.moe.top_k", model.resolved.moe.top_k, 1, 65536, "experts each token is routed to (<= experts)"),
      LOOM_INT("model.moe.d_expert", model.resolved.moe.d_expert, 0, kMaxWidth, "each expert's SwiGLU width (0: model.d_ff)"),
      LOOM_INT("model.moe.shared_experts", model.resolved.moe.shared_experts, 0, 65536,
               "experts every token passes through, unrouted (one SwiGLU MLP of shared_experts x d_expert)"),
      LOOM_INT("model.moe.every", model.resolved.moe.every, 1, 65536,
               "every k-th block (from model.moe.first_dense on) is a mixture of experts"),
      LOOM_INT("model.moe.first_dense", model.resolved.moe.first_dense, 0, 65536, "the first blocks keep a dense MLP"),
      Field{"model.moe.score", "string", "router scores: \"softmax\" (Mixtral) or \"sigmoid\" (DeepSeek-V3)",
            [](RunConfig& c, const toml::node& n) {
              c.model.resolved.moe.score = spec::parse_router_score(as_string(n, "model.moe.score"));
            },
            [](const RunConfig& c) { return quote(std::string(spec::router_score_name(c.model.resolved.moe.score))); }},
      LOOM_BOOL("model.moe.normalize_top_k", model.resolved.moe.normalize_top_k,
                "rescale each token's top-k expert weights to sum to 1"),
      LOOM_DOUBLE("model.moe.capacity_factor", model.resolved.moe.capacity_factor, ({0, 1e6}),
                  "tokens per expert = ceil(factor x tokens x top_k / experts), the rest dropped; 0: dropless"),
      LOOM_DOUBLE("model.moe.aux_loss_coef", model.resolved.moe.aux_loss_coef, ({0, 1e6}),
                  "weight of the Switch-style load-balancing loss (0: none)"),
      LOOM_DOUBLE("model.moe.bias_update_rate", model.resolved.moe.bias_update_rate, ({0, 1e6}),
                  "auxiliary-loss-free balancing: per-step move of each expert's selection bias (0: off)"),
      Field{"precision", "string",
            "\"fp32\", \"bf16\" (bf16 GEMMs, f32 accumulation and master weights), \"bf16-sr\" (bf16 whose "
            "weight copies are rounded stochastically after each update), \"bf16-pure\" (weights and AdamW moments "
            "stored in bf16 only, no f32 master, every update rounded stochastically) or \"fp8\" (bf16 whose blocks' "
            "linears quantise their GEMM inputs to fp8 under fp8.recipe: an emulation of fp8 numerics, not a speed-up)",
            [](RunConfig& c, const toml::node& n) {
              const std::string v = as_string(n, "precision");
              if (v != "fp32" && v != "f32" && v != "bf16" && v != "bf16-sr" && v != "bf16-pure" && v != "fp8")
                throw ConfigError("precision = '" + v +
                                  "' is not supported (valid: \"fp32\", \"bf16\", \"bf16-sr\", \"bf16-pure\", \"fp8\")");
              c.pure_bf16 = v == "bf16-pure";
              c.fp8 = v == "fp8";
              c.stochastic_rounding = v == "bf16-sr" || c.pure_bf16;
              c.precision = model::parse_precision(v == "fp32" || v == "f32" ? v : "bf16");
            },
            [](const RunConfig& c) { return quote(c.precision_label()); }},
      LOOM_STRING("fp8.recipe", fp8_options.recipe,
                  "precision = \"fp8\": \"delayed\" (per-tensor scales from an amax history), \"current\" (per-tensor "
                  "scales from the tensor itself) or \"blockwise\" (1x128 activation and gradient blocks, 128x128 weight tiles)"),
      LOOM_INT("fp8.amax_history", fp8_options.amax_history, 1, 1024, "delayed scaling: steps of amax history per tensor"),
      LOOM_STRING("fp8.grad_format", fp8_options.grad_format,
                  "fp8 format of the output gradients: \"e5m2\" (range) or \"e4m3\" (precision)"),
      LOOM_INT("fp8.margin", fp8_options.margin, 0, 32, "delayed and current scaling: scales lowered by 2^margin"),
      LOOM_INT("train.seed", train.seed, 0, 9.2233720368547748e18, "seed of initialisation and data order"),
      LOOM_INT("train.steps", train.steps, 1, kMaxCount, "optimizer steps to run"),
      LOOM_INT("train.batch_size", train.batch_size, 1, kMaxWidth, "global batch in sequences per step"),
      LOOM_INT("train.micro_batch_size", train.micro_batch_size, 0, kMaxWidth,
               "sequences per forward/backward (0: batch_size / parallel.dp); must divide each rank's share of batch_size"),
      LOOM_INT("train.seq_len", train.seq_len, 0, kMaxWidth, "tokens per sequence (0: model.max_seq)"),
      LOOM_DOUBLE("train.lr", train.lr, ({0, 100, true}), "peak learning rate"),
      LOOM_DOUBLE("train.min_lr", train.min_lr, ({0, 100}), "learning rate at the end of the cosine decay"),
      LOOM_INT("train.warmup_steps", train.warmup_steps, 0, kMaxCount, "linear warm-up steps"),
      LOOM_DOUBLE("train.beta1", train.beta1, ({0, 1, false, true}), "AdamW beta1"),
      LOOM_DOUBLE("train.beta2", train.beta2, ({0, 1, false, true}), "AdamW beta2"),
      LOOM_DOUBLE("train.eps", train.eps, ({0, 1, true}), "AdamW epsilon"),
      LOOM_DOUBLE("train.weight_decay", train.weight_decay, ({0, 100}), "decoupled weight decay (matrices only)"),
      LOOM_DOUBLE("train.grad_clip", train.grad_clip, ({0, 1e12}), "max global gradient norm (0: no clipping)"),
      LOOM_INT("train.max_consecutive_skips", train.max_consecutive_skips, 0, kMaxCount,
               "steps in a row that may be skipped (non-finite loss or gradient, loss spike) before the run stops "
               "(0: stop at the first)"),
      LOOM_DOUBLE("train.loss_spike_zscore", train.loss_spike_zscore, ({0, 1e6}),
                  "skip a step whose loss is this many standard deviations above the recent mean (0: off)"),
      LOOM_INT("train.loss_spike_window", train.loss_spike_window, 2, kMaxCount,
               "applied steps the loss-spike mean and deviation are taken over"),
      Field{"train.recompute", "string",
            "\"none\", \"selective\" (backward recomputes the attention core: its output and softmax "
            "statistics are not kept) or \"full\" (each block keeps only its input and is run forward again "
            "in backward)",
            [](RunConfig& c, const toml::node& n) {
              c.train.recompute = spec::parse_recompute(as_string(n, "train.recompute"));
            },
            [](const RunConfig& c) { return quote(std::string(spec::recompute_name(c.train.recompute))); }},
      LOOM_INT("train.eval_every", train.eval_every, 0, kMaxCount, "steps between validation losses (0: never)"),
      LOOM_INT("train.eval_batches", train.eval_batches, 1, 1048576,
               "batches (of train.batch_size samples) per validation; the same samples under every layout"),
      LOOM_INT("train.log_every", train.log_every, 1, kMaxCount, "steps between progress lines"),
      LOOM_INT("train.threads", train.threads, 0, 4096, "compute threads (0: all cores; LOOM_THREADS overrides)"),
      LOOM_STRING("train.out_dir", train.out_dir, "directory for metrics.jsonl and manifest.json"),
      LOOM_STRING("data.source", data.source, "\"synthetic\" (a learnable token stream) or \"shards\" (a corpus from `loom prepare`)"),
      LOOM_STRING("data.dir", data.dir, "shard folder written by `loom prepare --out` (data.source = \"shards\")"),
      LOOM_STRING("checkpoint.dir", checkpoint.dir, "directory of this run's checkpoints (step-NNNNNNNN/ and `latest`)"),
      LOOM_INT("checkpoint.save_every", checkpoint.save_every, 0, kMaxCount, "steps between checkpoints (0: only on SIGTERM)"),
      LOOM_INT("checkpoint.keep", checkpoint.keep, 0, 1048576, "keep the newest K checkpoints of this run (0: all)"),
      LOOM_STRING("checkpoint.format", checkpoint.format,
                  "\"sharded\" (each rank writes its own pieces, rank 0 the index) or \"whole\" (gathered to rank 0 as whole tensors)"),
      LOOM_BOOL("checkpoint.async", checkpoint.async,
                "periodic saves: rank 0 copies the state at the step boundary and writes it on a background thread "
                "while training goes on (the last and a preempted run's saves are waited for)"),
      LOOM_STRING("trace.file", trace.file, "write a Chrome/Perfetto trace JSON here (empty: no trace)"),
      LOOM_BOOL("trace.summary", trace.summary, "print time per kernel at the end of the run"),
      LOOM_INT("parallel.dp", parallel.dp, 1, 65536, "data-parallel degree"),
      LOOM_INT("parallel.tp", parallel.tp, 1, 65536, "tensor-parallel degree"),
      LOOM_BOOL("parallel.sequence_parallel", parallel.sequence_parallel,
                "with tp > 1: shard the norm and residual regions along the token rows (each all-reduce becomes "
                "reduce-scatter + all-gather; their activation memory drops by tp)"),
      LOOM_BOOL("parallel.tp_overlap", parallel.tp_overlap,
                "with tp > 1: run the weight-gradient GEMM while the input-gradient collective is in flight"),
      LOOM_INT("parallel.pp", parallel.pp, 1, 65536, "pipeline-parallel degree"),
      LOOM_STRING("parallel.pipeline.schedule", parallel.pipeline_schedule,
                  "with pp > 1: \"gpipe\", \"1f1b\", \"interleaved-1f1b\" or \"zb-h1\" (tp = 1)"),
      LOOM_INT("parallel.pipeline.virtual_stages", parallel.pipeline_virtual_stages, 1, 65536,
               "model chunks per pipeline rank (interleaved-1f1b: at least 2)"),
      LOOM_STRING("parallel.pipeline.layers", parallel.pipeline_layers,
                  "blocks per chunk, e.g. \"7,8,8,7\" (empty: balanced by declared cost)"),
      LOOM_BOOL("parallel.pipeline.bf16_transfers", parallel.pipeline_bf16_transfers,
                "in bf16 runs: activations and their gradients cross stages in bf16 (half the bytes; false: f32, "
                "which reproduces one rank's numbers exactly)"),
      LOOM_INT("parallel.cp", parallel.cp, 1, 65536,
               "context-parallel degree: each sample's tokens split over cp ranks (head and tail chunks)"),
      LOOM_STRING("parallel.cp_mode", parallel.cp_mode,
                  "with cp > 1: \"ring\" (K/V pass around the group under the attention) or \"all-to-all\" "
                  "(Ulysses: heads split over the group; cp must divide the heads)"),
      LOOM_INT("parallel.ep", parallel.ep, 1, 65536, "expert-parallel degree"),
      LOOM_INT("parallel.zero", parallel.zero, 0, 3, "ZeRO stage 0-3"),
      LOOM_INT("parallel.bucket_kb", parallel.bucket_kb, 0, kMaxWidth,
               "KiB of gradients per data-parallel all-reduce, issued during backward (0: one after backward)"),
      LOOM_STRING("parallel.zero_release", parallel.zero_release,
                  "how ZeRO-2/3 give back the pages of gathered weights and gradient scratch: \"lazy\" (the kernel "
                  "reclaims them when memory runs short; no page faults on reuse) or \"eager\" (at once: the "
                  "resident size follows the sharding, every reuse page-faults)"),
  };
  return f;
}

const Field* find_field(const std::string& key) {
  for (auto& f : fields())
    if (f.key == key) return &f;
  return nullptr;
}

// Suggests the known key closest in edit distance, for typos.
std::string closest_key(const std::string& key) {
  auto dist = [](const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= b.size(); ++j)
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      std::swap(prev, cur);
    }
    return prev[b.size()];
  };
  std::string best;
  size_t best_d = 1000;
  for (auto& f : fields()) {
    size_t d = dist(key, f.key);
    if (d < best_d) best_d = d, best = f.key;
  }
  return best_d <= 4 ? best : "";
}

void flatten(const toml::table& t, const std::string& prefix, std::vector<std::pair<std::string, const toml::node*>>& out) {
  for (auto& [k, v] : t) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (auto sub = v.as_table())
      flatten(*sub, key, out);
    else
      out.emplace_back(key, &v);
  }
}

toml::table parse_toml(const std::string& text, const std::string& origin) {
  try {
    return toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    throw ConfigError(origin + ":" + std::to_string(b.line) + ":" + std::to_string(b.column) + ": " +
                      std::string(e.description()));
  }
}

}  // namespace

RunConfig parse_run_config(const std::string& text, const std::string& origin,
                           const std::vector<std::string>& overrides) {
  std::vector<toml::table> tables;  // keeps override nodes alive
  tables.push_back(parse_toml(text, origin));
  std::vector<std::pair<std::string, const toml::node*>> entries;
  std::vector<std::string> where;
  flatten(tables.back(), "", entries);
  where.assign(entries.size(), origin);
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      throw ConfigError("--set '" + o + "' is not key=value (example: --set train.lr=3e-4)");
    std::string key = o.substr(0, eq), value = o.substr(eq + 1);
    toml::table t;
    try {
      t = toml::parse(key + " = " + value);
    } catch (const toml::parse_error&) {
      t = parse_toml(key + " = " + quote(value), "--set " + o);  // bare words are strings
    }
    tables.push_back(std::move(t));
    size_t before = entries.size();
    flatten(tables.back(), "", entries);
    where.resize(entries.size(), "--set " + o);
    (void)before;
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!find_field(entries[i].first)) {
      std::string hint = closest_key(entries[i].first);
      throw ConfigError("unknown key '" + entries[i].first + "' in " + where[i] +
                        (hint.empty() ? "" : " (did you mean '" + hint + "'?)") + "; `loom train --help` lists every key");
    }
  }
  RunConfig c;
  for (auto& [key, node] : entries)
    if (key == "model.preset") find_field(key)->set(c, *node);
  c.model.resolved = spec::preset(c.model.preset);
  for (auto& [key, node] : entries)
    if (key != "model.preset") find_field(key)->set(c, *node);
  c.model.resolved.name = c.model.preset;
  c.validate();
  return c;
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) throw IoError("cannot read config file '" + path + "': check the path (configs/ holds examples)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_run_config(ss.str(), path, overrides);
}

void RunConfig::validate() const {
  model.resolved.validate();
  auto s = [](int64_t v) { return std::to_string(v); };
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError(msg);
  };
  need(train.steps > 0, "train.steps must be positive (got " + s(train.steps) + ")");
  need(train.batch_size > 0, "train.batch_size must be positive (got " + s(train.batch_size) + ")");
  need(train.micro_batch_size >= 0, "train.micro_batch_size must be >= 0 (0 means batch_size)");
  // micro_batch_size = 0 means batch_size / dp, which is 0 when the batch is smaller than dp.
  need(micro_batch() > 0, "train.batch_size = " + s(train.batch_size) + " is smaller than parallel.dp = " +
                              s(parallel.dp) + ": every data-parallel rank needs at least one sequence per step");
  need(train.batch_size % micro_batch() == 0, "train.batch_size = " + s(train.batch_size) +
                                                  " is not divisible by train.micro_batch_size = " + s(micro_batch()));
  need(seq_len() > 0 && seq_len() <= model.resolved.max_seq,
       "train.seq_len = " + s(seq_len()) + " must be in [1, model.max_seq = " + s(model.resolved.max_seq) + "]");
  need(train.lr > 0 && train.min_lr >= 0 && train.min_lr <= train.lr,
       "learning rates need 0 <= train.min_lr <= train.lr and train.lr > 0");
  need(train.warmup_steps >= 0, "train.warmup_steps must be >= 0");
  need(train.beta1 >= 0 && train.beta1 < 1 && train.beta2 >= 0 && train.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)");
  need(train.eps > 0, "train.eps must be positive");
  need(train.weight_decay >= 0 && train.grad_clip >= 0, "train.weight_decay and train.grad_clip must be >= 0");
  need(train.eval_every >= 0 && train.eval_batches > 0, "train.eval_every must be >= 0 and train.eval_batches > 0");
  need(train.log_every > 0, "train.log_every must be positive");
  need(train.threads >= 0, "train.threads must be >= 0");
  need(data.source == "synthetic" || data.source == "shards",
       "data.source = '" + data.source + "' is not known (valid: \"synthetic\", \"shards\")");
  need(data.source != "shards" || !data.dir.empty(),
       "data.source = \"shards\" needs data.dir: the folder `loom prepare --out DIR` wrote");
  need(checkpoint.save_every >= 0 && checkpoint.keep >= 0, "checkpoint.save_every and checkpoint.keep must be >= 0");
  need(!checkpoint.dir.empty(), "checkpoint.dir must not be empty");
  need(checkpoint.format == "sharded" || checkpoint.format == "whole",
       "checkpoint.format = \"" + checkpoint.format + "\" is not a checkpoint format (\"sharded\" or \"whole\")");
  need(fp8_options.recipe == "delayed" || fp8_options.recipe == "current" || fp8_options.recipe == "blockwise",
       "fp8.recipe = \"" + fp8_options.recipe + "\" is not a recipe (valid: \"delayed\", \"current\", \"blockwise\")");
  need(fp8_options.grad_format == "e5m2" || fp8_options.grad_format == "e4m3",
       "fp8.grad_format = \"" + fp8_options.grad_format + "\" is not an fp8 format (valid: \"e5m2\", \"e4m3\")");
  // The whole format gathers f32 masters on rank 0; bf16-pure has none (its sharded files hold the
  // bf16 values widened to f32, exactly).
  need(!(pure_bf16 && checkpoint.format == "whole"),
       "checkpoint.format = \"whole\" is not available with precision = \"bf16-pure\" (it gathers f32 master weights, "
       "which bf16-pure does not keep): use the default checkpoint.format = \"sharded\"");
  const ParallelSection& p = parallel;
  need(p.bucket_kb >= 0 && p.bucket_kb <= (int64_t{1} << 24),
       "parallel.bucket_kb must be 0..16777216 (0: one all-reduce after backward)");
  auto degree_ok = [](int64_t d) { return d >= 1 && d <= 65536; };
  need(degree_ok(p.dp) && degree_ok(p.tp) && degree_ok(p.pp) && degree_ok(p.cp) && degree_ok(p.ep),
       "parallel degrees must be 1..65536 (dp=" + s(p.dp) + " tp=" + s(p.tp) + " pp=" + s(p.pp) + " cp=" + s(p.cp) +
           " ep=" + s(p.ep) + ")");
  need(p.zero_release == "lazy" || p.zero_release == "eager",
       "parallel.zero_release = \"" + p.zero_release + "\" is not a release mode (\"lazy\" or \"eager\")");
  need(p.zero >= 0 && p.zero <= 3, "parallel.zero = " + s(p.zero) + " is not a ZeRO stage (0, 1, 2 or 3)");
  if (p.ep > 1) {
    // Expert parallelism splits each MoE block's experts over ep of the data-parallel ranks.
    const int64_t E = model.resolved.moe.experts;
    need(model.resolved.moe.enabled(), "parallel.ep = " + s(p.ep) +
                                           " needs a mixture-of-experts model: set model.moe.experts (docs/moe.md)");
    need(p.dp % p.ep == 0, "parallel.ep = " + s(p.ep) + " must divide parallel.dp = " + s(p.dp) +
                               ": the expert-parallel groups are drawn from the data-parallel ranks");
    std::string valid;
    for (int64_t d = 1; d <= std::min<int64_t>(E, p.dp); ++d)
      if (E % d == 0 && p.dp % d == 0) valid += (valid.empty() ? "" : ", ") + s(d);
    need(E % p.ep == 0, "parallel.ep = " + s(p.ep) + " does not divide model.moe.experts = " + s(E) +
                            " (each ep rank holds experts / ep of them); valid ep here: " + valid);
    need(checkpoint.format == "sharded", "parallel.ep = " + s(p.ep) + " saves sharded checkpoints only (each expert is "
                                         "held by one rank of each ep group); use checkpoint.format = \"sharded\"");
  }
  const spec::CpMode cp_mode = spec::parse_cp_mode(p.cp_mode);
  if (p.cp > 1) spec::validate_context_parallel(model.resolved, seq_len(), static_cast<int>(p.cp), cp_mode,
                                                static_cast<int>(p.tp));
  need(p.pipeline_virtual_stages == 1 || p.pp > 1,
       "parallel.pipeline.virtual_stages = " + s(p.pipeline_virtual_stages) + " needs parallel.pp > 1");
  need(p.pipeline_layers.empty() || p.pp > 1,
       "parallel.pipeline.layers = \"" + p.pipeline_layers + "\" cuts a pipeline, which needs parallel.pp > 1");
  if (p.pp > 1) {
    // The schedule and the cut must be possible before any rank starts.
    const auto kind = spec::parse_schedule(p.pipeline_schedule);
    need(kind != spec::PipelineSchedule::ZeroBubbleH1 || p.tp == 1,
         "parallel.pipeline.schedule = \"zb-h1\" with parallel.tp = " + s(p.tp) +
             " is not supported yet: the tensor-parallel ops do not split their backward into input- and "
             "weight-gradient passes; use \"1f1b\" with tp, or zb-h1 with tp = 1");
    need(kind != spec::PipelineSchedule::ZeroBubbleH1 || train.recompute == spec::Recompute::None,
         "parallel.pipeline.schedule = \"zb-h1\" with train.recompute = \"" +
             std::string(spec::recompute_name(train.recompute)) +
             "\" is not supported: zb-h1's weight-gradient passes read GEMM inputs that recompute does not keep; "
             "use \"1f1b\" (or \"gpipe\", \"interleaved-1f1b\") with recompute, or train.recompute = \"none\"");
    // ZeRO-1 reduces every gradient once, after the schedule; ZeRO-2/3 keep no whole gradient and reduce
    // (and free) each block's during its backward, once per micro-batch, in the order of one backward.
    need(p.zero <= 1 || p.dp * p.cp == 1,
         "parallel.pp = " + s(p.pp) + " with parallel.zero = " + s(p.zero) +
             " is not supported: ZeRO-2/3 reduce and free each block's gradients during every micro-batch's "
             "backward, which a pipeline schedule interleaves across micro-batches; use parallel.zero = 1 "
             "(optimizer state sharded over dp) or 0");
    const int64_t share = train.batch_size / std::max<int64_t>(p.dp, 1);
    spec::build_pipeline_schedule(kind, static_cast<int>(p.pp), static_cast<int>(p.pipeline_virtual_stages),
                                  static_cast<int>(std::max<int64_t>(1, share / std::max<int64_t>(micro_batch(), 1))));
    spec::cut_pipeline(model.resolved, seq_len(), static_cast<int>(p.pp), static_cast<int>(p.pipeline_virtual_stages),
                       spec::parse_layer_counts(p.pipeline_layers, "parallel.pipeline.layers"));
  }
  spec::validate_tensor_parallel(model.resolved, static_cast<int>(p.tp));
  if (model.resolved.moe.enabled()) {
    // What the mixture-of-experts block does not combine with yet, refused before any rank starts.
    const std::string moe = "model.moe.experts = " + s(model.resolved.moe.experts) + " with ";
    need(p.cp == 1, moe + "parallel.cp = " + s(p.cp) +
                        " is not supported yet: expert capacity and the load-balancing loss are per micro-batch of whole "
                        "sequences; use parallel.cp = 1");
    need(!fp8, moe + "precision = \"fp8\" is not supported yet: the experts' GEMMs have no fp8 scaling state; use "
                     "precision = \"bf16\"");
    need(p.pp == 1 || spec::parse_schedule(p.pipeline_schedule) != spec::PipelineSchedule::ZeroBubbleH1,
         moe + "parallel.pipeline.schedule = \"zb-h1\" is not supported yet: the experts' backward is not split into "
               "input- and weight-gradient passes; use \"1f1b\"");
  }
  if (p.sequence_parallel && p.tp > 1 && (micro_batch() * (seq_len() / p.cp)) % p.tp != 0) {
    // Each rank holds a contiguous run of the micro-batch's token rows (of its cp share); suggest the
    // nearest lengths that split.
    const int64_t step = p.tp / std::gcd(p.tp, micro_batch()) * (p.cp > 1 ? 2 * p.cp : 1);
    const int64_t below = seq_len() / step * step, above = below + step;
    throw ConfigError("parallel.sequence_parallel at parallel.tp = " + s(p.tp) + " splits the " + s(micro_batch()) +
                      " x " + s(seq_len() / p.cp) + " token rows of a micro-batch (train.micro_batch_size x " +
                      (p.cp > 1 ? "train.seq_len / parallel.cp" : "train.seq_len") +
                      ") into tp equal runs, which does not divide; use train.seq_len = " +
                      (below > 0 ? s(below) + " or " : "") + s(above) + ", or sequence_parallel = false");
  }
  need(train.batch_size % (p.dp * micro_batch()) == 0,
       "train.batch_size = " + s(train.batch_size) + " must be divisible by parallel.dp x train.micro_batch_size = " +
           s(p.dp) + " x " + s(micro_batch()) + " (each data-parallel rank runs whole micro-batches of its share)");

  // Sizes the run derives from these keys, checked before anything is allocated: the largest buffer
  // of a micro-batch (the logits, or the widest activation), and the token offsets the data order
  // reaches (sample index x sequence length, training and validation).
  using spec::CheckedSize;
  const auto& m = model.resolved;
  const CheckedSize micro(micro_batch(), "train.micro_batch_size"), T(seq_len(), "train.seq_len"),
      steps(train.steps, "train.steps"), batch(train.batch_size, "train.batch_size"),
      evals(train.eval_batches, "train.eval_batches"), four = CheckedSize::constant(4);
  const int64_t kMaxBuffer = int64_t{1} << 46;  // 64 TiB: beyond any machine, far inside 64 bits
  const std::string fix = "lower train.micro_batch_size or train.seq_len";
  (micro * T * CheckedSize(m.vocab_size, "model.vocab_size") * four).at_most(kMaxBuffer, "bytes of one micro-batch's logits", fix);
  (micro * T * CheckedSize(std::max(m.d_ff, m.d_model), m.d_ff >= m.d_model ? "model.d_ff" : "model.d_model") *
   CheckedSize::constant(8))
      .at_most(kMaxBuffer, "bytes of one micro-batch's widest activation", fix);
  (steps * batch * T).at_most(int64_t{1} << 62, "tokens the run reads", "lower train.steps or train.batch_size");
  (evals * batch * T).at_most(int64_t{1} << 62, "tokens one validation reads", "lower train.eval_batches");

}

std::vector<std::pair<std::string, std::string>> RunConfig::key_values() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& f : fields()) out.emplace_back(f.key, f.get(*this));
  return out;
}

std::string RunConfig::to_toml() const {
  // Top-level keys must come before the first [table] header.
  std::string top, tables, section;
  for (auto& f : fields()) {
    auto dot = f.key.find('.');
    if (dot == std::string::npos) {
      top += f.key + " = " + f.get(*this) + "\n";
      continue;
    }
    std::string sec = f.key.substr(0, dot);
    if (sec != section) {
      tables += "\n[" + sec + "]\n";
      section = sec;
    }
    tables += f.key.substr(dot + 1) + " = " + f.get(*this) + "\n";
  }
  return top + tables;
}

std::vector<ConfigKeyInfo> config_keys() {
  std::vector<ConfigKeyInfo> out;
  for (const auto& f : fields()) {
    ConfigKeyInfo k{f.key, f.type};
    if (f.range) k.numeric = true, k.lo = f.range->lo, k.hi = f.range->hi, k.lo_open = f.range->lo_open, k.hi_open = f.range->hi_open;
    out.push_back(k);
  }
  return out;
}

std::string config_reference() {
  RunConfig defaults;
  defaults.model.resolved = spec::preset(defaults.model.preset);
  std::string out;
  for (auto& f : fields())
    out += fmt::format("  {:<26} {:<8} {}{}  (default {})\n", f.key, f.type, f.doc,
                       f.range ? " " + f.range->str(f.type == "integer") : "", f.get(defaults));
  return out;
}

}  // namespace loom::train
