#include "loom/train/run_config.h"

#include <fmt/format.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <toml++/toml.h>

#include "loom/error.h"

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
std::string quote(const std::string& s) {
  std::string o = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\')
      o += '\\', o += static_cast<char>(ch);
    else if (ch < 0x20 || ch == 0x7f)
      o += fmt::format("\\u{:04x}", ch);
    else
      o += static_cast<char>(ch);
  }
  return o + "\"";
}
// Shortest text that reads back to the same value; always a TOML float.
template <typename T>
std::string num(T v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".e") == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
  return s;
}

struct Field {
  std::string key;
  std::string type;
  std::string doc;
  std::function<void(RunConfig&, const toml::node&)> set;
  std::function<std::string(const RunConfig&)> get;  // a TOML literal
};

#define LOOM_INT(KEY, MEMBER, DOC) \
  Field{KEY, "integer", DOC, [](RunConfig& c, const toml::node& n) { c.MEMBER = as_int(n, KEY); }, \
        [](const RunConfig& c) { return std::to_string(c.MEMBER); }}
#define LOOM_DOUBLE(KEY, MEMBER, DOC) \
  Field{KEY, "number", DOC, [](RunConfig& c, const toml::node& n) { c.MEMBER = as_double(n, KEY); }, \
        [](const RunConfig& c) { return num(c.MEMBER); }}
#define LOOM_BOOL(KEY, MEMBER, DOC) \
  Field{KEY, "bool", DOC, [](RunConfig& c, const toml::node& n) { c.MEMBER = as_bool(n, KEY); }, \
        [](const RunConfig& c) { return std::string(c.MEMBER ? "true" : "false"); }}
#define LOOM_STRING(KEY, MEMBER, DOC) \
  Field{KEY, "string", DOC, [](RunConfig& c, const toml::node& n) { c.MEMBER = as_string(n, KEY); }, \
        [](const RunConfig& c) { return quote(c.MEMBER); }}

// The one place each configuration key is defined and documented.
const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      LOOM_STRING("model.preset", model.preset, "model preset: tiny, tiny-llama, mini, gpt2-124m, llama-mini"),
      Field{"model.arch", "string", "architecture family: \"gpt2\" or \"llama\" (overrides the preset's)",
            [](RunConfig& c, const toml::node& n) { c.model.resolved.arch = spec::parse_arch(as_string(n, "model.arch")); },
            [](const RunConfig& c) { return quote(std::string(spec::arch_name(c.model.resolved.arch))); }},
      LOOM_INT("model.vocab_size", model.resolved.vocab_size, "vocabulary size V"),
      LOOM_INT("model.max_seq", model.resolved.max_seq, "context length the model is built for"),
      LOOM_INT("model.d_model", model.resolved.d_model, "residual width C"),
      LOOM_INT("model.n_layers", model.resolved.n_layers, "number of transformer blocks L"),
      LOOM_INT("model.n_heads", model.resolved.n_heads, "attention heads H (must divide d_model)"),
      LOOM_INT("model.n_kv_heads", model.resolved.n_kv_heads, "key/value heads (GQA, llama only; must divide n_heads)"),
      LOOM_INT("model.d_ff", model.resolved.d_ff, "MLP hidden width (SwiGLU: width of gate and of up)"),
      Field{"model.norm_eps", "number", "epsilon of LayerNorm / RMSNorm",
            [](RunConfig& c, const toml::node& n) { c.model.resolved.norm_eps = static_cast<float>(as_double(n, "model.norm_eps")); },
            [](const RunConfig& c) { return num(c.model.resolved.norm_eps); }},
      Field{"model.rope_theta", "number", "rotary embedding base (llama)",
            [](RunConfig& c, const toml::node& n) { c.model.resolved.rope_theta = static_cast<float>(as_double(n, "model.rope_theta")); },
            [](const RunConfig& c) { return num(c.model.resolved.rope_theta); }},
      LOOM_BOOL("model.tie_embeddings", model.resolved.tie_embeddings, "LM head shares the token embedding"),
      Field{"model.init_std", "number", "standard deviation of the normal initialisation",
            [](RunConfig& c, const toml::node& n) { c.model.resolved.init_std = static_cast<float>(as_double(n, "model.init_std")); },
            [](const RunConfig& c) { return num(c.model.resolved.init_std); }},
      Field{"precision", "string", "\"fp32\" or \"bf16\" (bf16 GEMMs, f32 accumulation and master weights)",
            [](RunConfig& c, const toml::node& n) { c.precision = model::parse_precision(as_string(n, "precision")); },
            [](const RunConfig& c) { return quote(model::precision_name(c.precision)); }},
      Field{"train.seed", "integer", "seed of initialisation and data order",
            [](RunConfig& c, const toml::node& n) { c.train.seed = static_cast<uint64_t>(as_int(n, "train.seed")); },
            [](const RunConfig& c) { return std::to_string(c.train.seed); }},
      LOOM_INT("train.steps", train.steps, "optimizer steps to run"),
      LOOM_INT("train.batch_size", train.batch_size, "global batch in sequences per step"),
      LOOM_INT("train.micro_batch_size", train.micro_batch_size, "sequences per forward/backward (0: batch_size / parallel.dp); must divide each rank's share of batch_size"),
      LOOM_INT("train.seq_len", train.seq_len, "tokens per sequence (0: model.max_seq)"),
      LOOM_DOUBLE("train.lr", train.lr, "peak learning rate"),
      LOOM_DOUBLE("train.min_lr", train.min_lr, "learning rate at the end of the cosine decay"),
      LOOM_INT("train.warmup_steps", train.warmup_steps, "linear warm-up steps"),
      LOOM_DOUBLE("train.beta1", train.beta1, "AdamW beta1"),
      LOOM_DOUBLE("train.beta2", train.beta2, "AdamW beta2"),
      LOOM_DOUBLE("train.eps", train.eps, "AdamW epsilon"),
      LOOM_DOUBLE("train.weight_decay", train.weight_decay, "decoupled weight decay (matrices only)"),
      LOOM_DOUBLE("train.grad_clip", train.grad_clip, "max global gradient norm (0: no clipping)"),
      LOOM_INT("train.eval_every", train.eval_every, "steps between validation losses (0: never)"),
      LOOM_INT("train.eval_batches", train.eval_batches, "batches (of train.batch_size samples) per validation; the same samples under every layout"),
      LOOM_INT("train.log_every", train.log_every, "steps between progress lines"),
      Field{"train.threads", "integer", "compute threads (0: all cores; LOOM_THREADS overrides)",
            [](RunConfig& c, const toml::node& n) { c.train.threads = static_cast<int>(as_int(n, "train.threads")); },
            [](const RunConfig& c) { return std::to_string(c.train.threads); }},
      LOOM_STRING("train.out_dir", train.out_dir, "directory for metrics.jsonl and manifest.json"),
      LOOM_STRING("data.source", data.source, "\"synthetic\" (a learnable token stream) or \"shards\" (a corpus from `loom prepare`)"),
      LOOM_STRING("data.dir", data.dir, "shard folder written by `loom prepare --out` (data.source = \"shards\")"),
      LOOM_STRING("checkpoint.dir", checkpoint.dir, "directory of this run's checkpoints (step-NNNNNNNN/ and `latest`)"),
      LOOM_INT("checkpoint.save_every", checkpoint.save_every, "steps between checkpoints (0: only on SIGTERM)"),
      LOOM_INT("checkpoint.keep", checkpoint.keep, "keep the newest K checkpoints of this run (0: all)"),
      LOOM_STRING("trace.file", trace.file, "write a Chrome/Perfetto trace JSON here (empty: no trace)"),
      LOOM_BOOL("trace.summary", trace.summary, "print time per kernel at the end of the run"),
      LOOM_INT("parallel.dp", parallel.dp, "data-parallel degree"),
      LOOM_INT("parallel.tp", parallel.tp, "tensor-parallel degree"),
      LOOM_INT("parallel.pp", parallel.pp, "pipeline-parallel degree"),
      LOOM_INT("parallel.cp", parallel.cp, "context-parallel degree"),
      LOOM_INT("parallel.ep", parallel.ep, "expert-parallel degree"),
      LOOM_INT("parallel.zero", parallel.zero, "ZeRO stage 0-3"),
      LOOM_INT("parallel.bucket_kb", parallel.bucket_kb,
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
  need(p.tp == 1 && p.pp == 1 && p.cp == 1 && p.ep == 1,
       "parallel layout dp=" + s(p.dp) + " tp=" + s(p.tp) + " pp=" + s(p.pp) + " cp=" + s(p.cp) + " ep=" + s(p.ep) +
           " is not supported yet: this build runs data parallelism only (parallel.dp = N with parallel.zero = "
           "0..3, every other degree 1)");
  need(train.batch_size % (p.dp * micro_batch()) == 0,
       "train.batch_size = " + s(train.batch_size) + " must be divisible by parallel.dp x train.micro_batch_size = " +
           s(p.dp) + " x " + s(micro_batch()) + " (each data-parallel rank runs whole micro-batches of its share)");

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

std::string config_reference() {
  RunConfig defaults;
  defaults.model.resolved = spec::preset(defaults.model.preset);
  std::string out;
  for (auto& f : fields())
    out += fmt::format("  {:<26} {:<8} {}  (default {})\n", f.key, f.type, f.doc, f.get(defaults));
  return out;
}

}  // namespace loom::train
