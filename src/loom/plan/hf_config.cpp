#include "loom/plan/hf_config.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "loom/core/file_reader.h"
#include "loom/error.h"

namespace loom::plan {

namespace {

using nlohmann::json;

// Reads the fields of one config, each named in its error.
class Fields {
 public:
  Fields(const json& j, std::string origin) : j_(j), origin_(std::move(origin)) {}

  std::optional<json> get(const char* key) const {
    if (!j_.contains(key) || j_[key].is_null()) return std::nullopt;
    return j_[key];
  }
  int64_t integer(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    auto v = get(key);
    if (!v) {
      if (fallback) return *fallback;
      throw ConfigError(origin_ + ": \"" + key + "\" is missing (a " + family() + " config.json has it)");
    }
    // 4096.0 is an integer too (some exporters write every number as a float).
    const bool integral = v->is_number_integer() ||
                          (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
                           std::abs(v->get<double>()) < 9e15);
    if (!integral || v->get<double>() < 1)
      throw ConfigError(origin_ + ": \"" + key + "\" = " + v->dump() + " must be a positive integer");
    return static_cast<int64_t>(v->get<double>());
  }
  double number(const char* key, double fallback) const {
    auto v = get(key);
    if (!v) return fallback;
    if (!v->is_number() || !(v->get<double>() > 0))
      throw ConfigError(origin_ + ": \"" + key + "\" = " + v->dump() + " must be a positive number");
    return v->get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    auto v = get(key);
    if (!v) return fallback;
    if (!v->is_boolean()) throw ConfigError(origin_ + ": \"" + key + "\" = " + v->dump() + " must be true or false");
    return v->get<bool>();
  }
  std::string family() const { return j_.value("model_type", std::string("Hugging Face")); }

 private:
  const json& j_;
  std::string origin_;
};

}  // namespace

PlanModel parse_hf_config(const std::string& text, const std::string& origin) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    throw ConfigError(origin + ": not a JSON object (expected a Hugging Face config.json)");
  const Fields f(j, origin);
  if (!j.contains("model_type") || !j["model_type"].is_string())
    throw ConfigError(origin + ": \"model_type\" is missing: a Hugging Face config.json names its family "
                      "(gpt2, llama, mistral, mixtral)");
  const std::string type = j["model_type"];
  PlanModel m;
  auto& c = m.cfg;
  c.name = j.contains("_name_or_path") && j["_name_or_path"].is_string()
               ? j["_name_or_path"].get<std::string>()
               : std::filesystem::path(origin).parent_path().filename().string();
  if (c.name.empty()) c.name = std::filesystem::path(origin).stem().string();
  m.source = "Hugging Face config.json (" + origin + ")";
  if (type == "gpt2") {
    c.arch = spec::Arch::GPT2;
    c.n_layers = f.integer("n_layer");
    c.d_model = f.integer("n_embd");
    c.n_heads = c.n_kv_heads = f.integer("n_head");
    c.vocab_size = f.integer("vocab_size");
    c.max_seq = f.get("n_positions") ? f.integer("n_positions") : f.integer("n_ctx");
    c.d_ff = f.integer("n_inner", 4 * c.d_model);
    c.norm_eps = static_cast<float>(f.number("layer_norm_epsilon", 1e-5));
    c.tie_embeddings = f.boolean("tie_word_embeddings", true);
  } else if (type == "llama" || type == "mistral" || type == "mixtral") {
    c.arch = spec::Arch::Llama;
    c.n_layers = f.integer("num_hidden_layers");
    c.d_model = f.integer("hidden_size");
    c.n_heads = f.integer("num_attention_heads");
    c.n_kv_heads = f.integer("num_key_value_heads", c.n_heads);
    c.d_ff = f.integer("intermediate_size");
    c.vocab_size = f.integer("vocab_size");
    c.max_seq = f.integer("max_position_embeddings");
    c.norm_eps = static_cast<float>(f.number("rms_norm_eps", 1e-6));
    c.rope_theta = static_cast<float>(f.number("rope_theta", 10000));
    c.tie_embeddings = f.boolean("tie_word_embeddings", false);
    if (f.boolean("attention_bias", false) || f.boolean("mlp_bias", false))
      throw ConfigError(origin + ": \"attention_bias\" / \"mlp_bias\" = true: Loom's Llama-style block has no "
                        "biases, so its parameters, memory and time would not be this model's");
    if (auto hd = f.get("head_dim"); hd && (!hd->is_number() || hd->get<double>() * c.n_heads != c.d_model))
      throw ConfigError(origin + ": \"head_dim\" = " + hd->dump() + " is not hidden_size / num_attention_heads = " +
                        std::to_string(c.d_model / c.n_heads) + ": Loom's block derives the head width from them");
    if (type == "mixtral") {
      c.moe.experts = f.integer("num_local_experts");
      c.moe.top_k = f.integer("num_experts_per_tok");
      if (c.moe.top_k > c.moe.experts)
        throw ConfigError(origin + ": \"num_experts_per_tok\" = " + std::to_string(c.moe.top_k) +
                          " is more than \"num_local_experts\" = " + std::to_string(c.moe.experts));
    }
  } else {
    throw ConfigError(origin + ": model_type \"" + type +
                      "\" is not a family the planner describes (gpt2, llama, mistral, mixtral); give its shape as "
                      "Loom's [model] table in a .toml instead");
  }
  try {
    c.validate();  // the parameter count's bound included
  } catch (const ConfigError& e) {
    throw ConfigError(origin + ": " + e.what());
  }
  return m;
}

PlanModel load_hf_config(const std::string& path) { return parse_hf_config(read_file(path), path); }

}  // namespace loom::plan
