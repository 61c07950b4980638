#include "loom/model/generator.h"

#include <cmath>
#include <cstring>

#include "loom/error.h"
#include "loom/kernels/elementwise.h"

namespace loom::model {

Generator::Generator(spec::TransformerConfig cfg, const ParameterStore& P, kernels::Backend& backend)
    : cfg_(std::move(cfg)), backend_(backend), llama_(cfg_.arch == spec::Arch::Llama) {
  const int64_t T = cfg_.max_seq, C = cfg_.d_model, D = cfg_.head_dim(), H = cfg_.n_heads, KV = cfg_.n_kv_heads;
  const int64_t F = cfg_.d_ff, QKV = (H + 2 * KV) * D;
  Allocator& alloc = backend_.allocator();
  auto f32 = [&](Shape s) { return Tensor::empty(s, DType::F32, alloc, MemCategory::Activations); };
  auto opt = [&](const std::string& name) { return P.table().index_of(name) ? P.param(name) : Tensor(); };
  if (llama_) {
    wte_ = P.param("model.embed_tokens.weight");
    for (int64_t l = 0; l < cfg_.n_layers; ++l) {
      std::string p = "model.layers." + std::to_string(l) + ".";
      Layer L;
      L.n1_w = P.param(p + "input_layernorm.weight");
      L.qkv_w = P.param_rows(p + "self_attn.q_proj.weight", p + "self_attn.v_proj.weight");
      L.out_w = P.param(p + "self_attn.o_proj.weight");
      L.n2_w = P.param(p + "post_attention_layernorm.weight");
      L.up_w = P.param_rows(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight");
      L.down_w = P.param(p + "mlp.down_proj.weight");
      layers_.push_back(std::move(L));
    }
    nf_w_ = P.param("model.norm.weight");
    head_w_ = cfg_.tie_embeddings ? wte_ : P.param("lm_head.weight");
    rope_cos_ = f32({T, D / 2}), rope_sin_ = f32({T, D / 2});
    kernels::rope_tables(rope_cos_.data<float>(), rope_sin_.data<float>(), T, D, cfg_.rope_theta);
  } else {
    wte_ = P.param("transformer.wte.weight"), wpe_ = P.param("transformer.wpe.weight");
    for (int64_t l = 0; l < cfg_.n_layers; ++l) {
      std::string p = "transformer.h." + std::to_string(l) + ".";
      Layer L;
      L.n1_w = P.param(p + "ln_1.weight"), L.n1_b = P.param(p + "ln_1.bias");
      L.qkv_w = P.param(p + "attn.c_attn.weight"), L.qkv_b = P.param(p + "attn.c_attn.bias");
      L.out_w = P.param(p + "attn.c_proj.weight"), L.out_b = P.param(p + "attn.c_proj.bias");
      L.n2_w = P.param(p + "ln_2.weight"), L.n2_b = P.param(p + "ln_2.bias");
      L.up_w = P.param(p + "mlp.c_fc.weight"), L.up_b = P.param(p + "mlp.c_fc.bias");
      L.down_w = P.param(p + "mlp.c_proj.weight"), L.down_b = P.param(p + "mlp.c_proj.bias");
      layers_.push_back(std::move(L));
    }
    nf_w_ = P.param("transformer.ln_f.weight"), nf_b_ = P.param("transformer.ln_f.bias");
    head_w_ = cfg_.tie_embeddings ? wte_ : opt("lm_head.weight");
  }
  for (auto& L : layers_) L.k_cache = f32({T, KV * D}), L.v_cache = f32({T, KV * D});
  tokens_ = Tensor::empty({1, T}, DType::I32, alloc, MemCategory::Activations);
  x_ = f32({T, C}), h_ = f32({T, C}), qkv_ = f32({T, QKV}), q_ = f32({T, H * D}), att_ = f32({T, H * D});
  up_ = f32({T, llama_ ? 2 * F : F}), act_ = f32({T, F}), mean_ = f32({T}), rstd_ = f32({T});
  logits_ = f32({1, cfg_.vocab_size});
}

void Generator::norm(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& b, int64_t n) {
  if (llama_)
    backend_.rmsnorm_forward(out, rstd_.slice(0, n), x, w, cfg_.norm_eps);
  else
    backend_.layernorm_forward(out, mean_.slice(0, n), rstd_.slice(0, n), x, w, b, cfg_.norm_eps);
}

std::span<const float> Generator::feed(std::span<const int32_t> tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size()), pos = position_;
  if (n == 0) throw ConfigError("generate: nothing to feed (empty prompt)");
  if (pos + n > cfg_.max_seq)
    throw ConfigError("generation reached the model's context of " + std::to_string(cfg_.max_seq) +
                      " tokens; ask for fewer --max-tokens or a shorter prompt");
  for (int32_t t : tokens)
    if (t < 0 || t >= cfg_.vocab_size)
      throw ConfigError("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                        std::to_string(cfg_.vocab_size) + ")");
  const int64_t D = cfg_.head_dim(), H = cfg_.n_heads, KV = cfg_.n_kv_heads;
  const int64_t QKV = (H + 2 * KV) * D;
  auto& be = backend_;
  auto bias = [](const Tensor& b) { return b.defined() ? &b : nullptr; };
  Tensor tok = tokens_.view(0, {1, n});
  std::memcpy(tok.raw(), tokens.data(), sizeof(int32_t) * static_cast<size_t>(n));
  Tensor x = x_.slice(0, n), h = h_.slice(0, n), qkv = qkv_.slice(0, n), q = q_.slice(0, n), att = att_.slice(0, n);
  Tensor up = up_.slice(0, n), act = act_.slice(0, n);
  if (llama_) {
    be.embedding_forward(x, tok, wte_, nullptr);
  } else {
    Tensor wpe = wpe_.slice(pos, pos + n);
    be.embedding_forward(x, tok, wte_, &wpe);
  }
  const kernels::AttentionShape rope_shape{1, n, H, KV, D, 1.0f};
  const kernels::DecodeShape ds{n, pos, H, KV, D, 1.0f / std::sqrt(static_cast<float>(D))};
  for (auto& L : layers_) {
    norm(h, x, L.n1_w, L.n1_b, n);
    be.linear_forward(qkv, h, L.qkv_w, bias(L.qkv_b), false);
    if (llama_) be.rope_forward(qkv, rope_cos_.slice(pos, pos + n), rope_sin_.slice(pos, pos + n), rope_shape);
    // Split each row into q (attended now) and k, v (appended to the cache).
    for (int64_t i = 0; i < n; ++i) {
      const float* row = qkv.data<float>() + i * QKV;
      std::memcpy(q.data<float>() + i * H * D, row, sizeof(float) * H * D);
      std::memcpy(L.k_cache.data<float>() + (pos + i) * KV * D, row + H * D, sizeof(float) * KV * D);
      std::memcpy(L.v_cache.data<float>() + (pos + i) * KV * D, row + (H + KV) * D, sizeof(float) * KV * D);
    }
    be.attention_decode(att, q, L.k_cache, L.v_cache, ds);
    be.linear_forward(x, att, L.out_w, bias(L.out_b), true);
    norm(h, x, L.n2_w, L.n2_b, n);
    be.linear_forward(up, h, L.up_w, bias(L.up_b), false);
    if (llama_)
      be.swiglu_forward(act, up);
    else
      be.gelu_forward(act, up);
    be.linear_forward(x, act, L.down_w, bias(L.down_b), true);
  }
  // Only the last position's logits are needed to pick the next token.
  Tensor last = x.slice(n - 1, n), hl = h.slice(0, 1);
  if (llama_)
    be.rmsnorm_forward(hl, rstd_.slice(0, 1), last, nf_w_, cfg_.norm_eps);
  else
    be.layernorm_forward(hl, mean_.slice(0, 1), rstd_.slice(0, 1), last, nf_w_, nf_b_, cfg_.norm_eps);
  be.linear_forward(logits_, hl, head_w_, nullptr, false);
  position_ += n;
  rows_computed_ += n;
  return {logits_.data<float>(), static_cast<size_t>(cfg_.vocab_size)};
}

}  // namespace loom::model
