#include "loom/spec/transformer_config.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "loom/error.h"
#include "loom/spec/param_table.h"

namespace loom::spec {

std::string_view arch_name(Arch a) { return a == Arch::GPT2 ? "gpt2" : "llama"; }

std::string_view router_score_name(RouterScore r) { return r == RouterScore::Softmax ? "softmax" : "sigmoid"; }

RouterScore parse_router_score(std::string_view s) {
  if (s == "softmax") return RouterScore::Softmax;
  if (s == "sigmoid") return RouterScore::Sigmoid;
  throw ConfigError("model.moe.score = '" + std::string(s) + "' is not known (valid: softmax, sigmoid)");
}

int64_t TransformerConfig::moe_layer_count() const {
  int64_t n = 0;
  for (int64_t l = 0; l < n_layers; ++l) n += is_moe_layer(l);
  return n;
}

Arch parse_arch(std::string_view s) {
  if (s == "gpt2") return Arch::GPT2;
  if (s == "llama") return Arch::Llama;
  throw ConfigError("model.arch = '" + std::string(s) + "' is not known (valid: gpt2, llama)");
}

void TransformerConfig::validate() const {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError(msg);
  };
  auto s = [](int64_t v) { return std::to_string(v); };
  need(vocab_size > 0, "model.vocab_size must be positive (got " + s(vocab_size) + ")");
  need(max_seq > 0, "model.max_seq must be positive (got " + s(max_seq) + ")");
  need(n_layers > 0, "model.n_layers must be positive (got " + s(n_layers) + ")");
  need(n_heads > 0 && d_model > 0, "model.d_model and model.n_heads must be positive");
  need(d_model % n_heads == 0, "model.d_model = " + s(d_model) + " is not divisible by model.n_heads = " +
                                   s(n_heads) + "; choose heads that divide d_model");
  need(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
       "model.n_kv_heads = " + s(n_kv_heads) + " must divide model.n_heads = " + s(n_heads));
  need(arch == Arch::Llama || n_kv_heads == n_heads,
       "model.n_kv_heads = " + s(n_kv_heads) + " differs from n_heads = " + s(n_heads) +
           ", but grouped-query attention needs arch = \"llama\"");
  need(arch != Arch::Llama || head_dim() % 2 == 0,
       "rotary embeddings need an even head dimension (d_model / n_heads = " + s(head_dim()) + ")");
  need(d_ff > 0, "model.d_ff must be positive (got " + s(d_ff) + ")");
  need(std::isfinite(norm_eps) && norm_eps > 0, "model.norm_eps must be positive and finite");
  need(std::isfinite(init_std) && init_std > 0, "model.init_std must be positive and finite");
  need(std::isfinite(rope_theta) && rope_theta > 0, "model.rope_theta must be positive and finite");
  if (moe.experts != 0) {
    const MoeConfig& m = moe;
    need(m.experts > 0, "model.moe.experts must be positive, or 0 for a dense model (got " + s(m.experts) + ")");
    need(m.top_k >= 1 && m.top_k <= m.experts, "model.moe.top_k = " + s(m.top_k) + " must be in [1, model.moe.experts = " +
                                                   s(m.experts) + "]: a token cannot go to more experts than there are");
    need(m.d_expert >= 0, "model.moe.d_expert must be positive, or 0 for model.d_ff (got " + s(m.d_expert) + ")");
    need(m.shared_experts >= 0, "model.moe.shared_experts must be 0 or more (got " + s(m.shared_experts) + ")");
    need(m.every >= 1, "model.moe.every must be at least 1 (got " + s(m.every) + ")");
    need(m.first_dense >= 0 && m.first_dense < n_layers,
         "model.moe.first_dense = " + s(m.first_dense) + " must be in [0, model.n_layers = " + s(n_layers) + ")");
    need(moe_layer_count() > 0, "model.moe.every = " + s(m.every) + " with first_dense = " + s(m.first_dense) +
                                    " leaves no block of the " + s(n_layers) + " a mixture of experts; lower model.moe.every");
    need(std::isfinite(m.capacity_factor) && m.capacity_factor >= 0,
         "model.moe.capacity_factor must be 0 (dropless) or positive and finite");
    need(std::isfinite(m.aux_loss_coef) && m.aux_loss_coef >= 0, "model.moe.aux_loss_coef must be 0 or more and finite");
    need(std::isfinite(m.bias_update_rate) && m.bias_update_rate >= 0,
         "model.moe.bias_update_rate must be 0 (off) or more and finite");
  }
  // Linear in the model's size and before any table is built: the count bounds every arena offset.
  checked_parameter_count(*this).at_most(kMaxParameters, "the model's parameter count",
                                         "lower model.n_layers, model.d_model, model.d_ff or model.vocab_size");
}

CheckedSize checked_parameter_count(const TransformerConfig& c) {
  using K = CheckedSize;
  const K V(c.vocab_size, "model.vocab_size"), T(c.max_seq, "model.max_seq"), C(c.d_model, "model.d_model"),
      L(c.n_layers, "model.n_layers"), F(c.d_ff, "model.d_ff"), H(c.n_heads, "model.n_heads"),
      KV(c.n_kv_heads, "model.n_kv_heads");
  const K D = K(c.head_dim(), "head_dim");
  const K one = K::constant(1), two = K::constant(2), three = K::constant(3);
  const K head = c.tie_embeddings ? K::constant(0) : V * C;
  // A mixture-of-experts block swaps its MLP for the router (E x C), E SwiGLU experts and the shared
  // experts' SwiGLU MLP (3 x width x C each).
  const K moe_layers(c.moe_layer_count(), "model.n_layers"), dense_layers(c.n_layers - c.moe_layer_count(), "model.n_layers");
  const K E(c.moe.experts, "model.moe.experts"), Fe(c.expert_width(), "model.moe.d_expert"),
      S(c.moe.shared_experts, "model.moe.shared_experts");
  const K bias = c.moe.bias_update_rate > 0 ? E : K::constant(0);
  const K moe_mlp = E * C + bias + three * E * Fe * C + three * S * Fe * C;
  if (c.arch == Arch::GPT2) {
    // wte, wpe; per block: ln_1 (2C), c_attn (3C x C + 3C), c_proj (C x C + C), ln_2 (2C), c_fc (F x C + F),
    // mlp c_proj (C x F + C); ln_f (2C); the untied head.
    const K attention = two * C + three * C * C + three * C + C * C + C + two * C;
    const K mlp = F * C + F + C * F + C;
    return V * C + T * C + L * attention + dense_layers * mlp + moe_layers * moe_mlp + two * C + head;
  }
  // embed_tokens; per block: two RMSNorm gains, q (H*D x C), k and v (KV*D x C each), o (C x H*D),
  // gate and up (F x C each), down (C x F); the final norm; the untied head.
  const K attention = two * C + H * D * C + two * KV * D * C + C * H * D;
  const K mlp = two * F * C + C * F;
  return V * C + L * attention + dense_layers * mlp + moe_layers * moe_mlp + one * C + head;
}

TransformerConfig preset(std::string_view name) {
  TransformerConfig c;
  c.name = std::string(name);
  if (name == "tiny") {
    c.vocab_size = 512, c.max_seq = 64, c.d_model = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 4, c.d_ff = 256;
  } else if (name == "tiny-llama") {
    c.arch = Arch::Llama, c.tie_embeddings = false;
    c.vocab_size = 512, c.max_seq = 64, c.d_model = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.d_ff = 192;
  } else if (name == "tiny-moe") {
    // Llama attention with a Mixtral-style mixture: 4 experts, top-2, every block.
    c.arch = Arch::Llama, c.tie_embeddings = false;
    c.vocab_size = 512, c.max_seq = 64, c.d_model = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.d_ff = 128;
    c.moe.experts = 4, c.moe.top_k = 2, c.moe.aux_loss_coef = 0.01;
  } else if (name == "mini") {
    c.vocab_size = 8192, c.max_seq = 256, c.d_model = 384, c.n_layers = 6, c.n_heads = 6, c.n_kv_heads = 6, c.d_ff = 1536;
  } else if (name == "gpt2-124m") {
    c.vocab_size = 50257, c.max_seq = 1024, c.d_model = 768, c.n_layers = 12, c.n_heads = 12, c.n_kv_heads = 12,
    c.d_ff = 3072;
  } else if (name == "llama-mini") {
    c.arch = Arch::Llama, c.tie_embeddings = false, c.norm_eps = 1e-5f;
    c.vocab_size = 8192, c.max_seq = 256, c.d_model = 384, c.n_layers = 6, c.n_heads = 6, c.n_kv_heads = 2, c.d_ff = 1024;
  } else if (name == "moe-mini") {
    // llama-mini's attention with 8 experts of width 512, top-2 (Mixtral's shape, scaled down): about
    // 4x llama-mini's MLP parameters, 1x its MLP FLOPs per token.
    c = preset("llama-mini");
    c.name = std::string(name);
    c.d_ff = 512;
    c.moe.experts = 8, c.moe.top_k = 2, c.moe.aux_loss_coef = 0.01;
  } else {
    std::string valid;
    for (auto& n : preset_names()) valid += (valid.empty() ? "" : ", ") + n;
    throw ConfigError("unknown model preset '" + std::string(name) + "' (valid: " + valid + ")");
  }
  return c;
}

std::vector<std::string> preset_names() {
  return {"tiny", "tiny-llama", "tiny-moe", "mini", "gpt2-124m", "llama-mini", "moe-mini"};
}

const char* token_embedding_name(Arch a) {
  return a == Arch::Llama ? "model.embed_tokens.weight" : "transformer.wte.weight";
}

double model_flops_per_token(const TransformerConfig& cfg, int64_t seq_len) {
  ParamTable table = build_param_table(cfg);
  // A token passes through top_k of the experts: the others' weights do no work for it.
  const double idle_experts = static_cast<double>(cfg.moe_layer_count()) * static_cast<double>(cfg.moe.experts - cfg.moe.top_k) *
                              3.0 * static_cast<double>(cfg.expert_width() * cfg.d_model);
  double dense = static_cast<double>(table.non_embedding_numel() + cfg.vocab_size * cfg.d_model) - idle_experts;
  double attention = 6.0 * static_cast<double>(cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim());
  return 6.0 * dense + attention;
}

int64_t MoeConfig::capacity(int64_t tokens) const {
  const int64_t pairs = tokens * top_k;
  if (capacity_factor <= 0 || experts <= 0) return pairs;
  return std::min(pairs, static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(pairs) /
                                                        static_cast<double>(experts))));
}

int64_t MoeConfig::expert_side_rows(int64_t tokens, int ep) const {
  const int64_t all = static_cast<int64_t>(ep) * tokens * top_k;
  if (capacity_factor <= 0 || ep <= 1) return all;
  return std::min(all, experts * capacity(tokens));
}

}  // namespace loom::spec
