#include "loom/model/generator.h"

#include <cmath>
#include <cstring>

#include "loom/error.h"

namespace loom::model {

// The new rows at positions [pos, pos + n): rotary embedding at their positions (Llama), keys and
// values appended to the layer's cache, queries attended against every cached position.
class Generator::CachedAttention final : public AttentionStep {
 public:
  CachedAttention(Generator& g, int64_t layer, int64_t pos, int64_t n) : g_(g), layer_(layer), pos_(pos), n_(n) {}
  void forward(const Tensor& att, const Tensor& /*lse*/, const Tensor& qkv) override {
    const auto& c = g_.cfg_;
    const int64_t D = c.head_dim(), H = c.n_heads, KV = c.n_kv_heads, QKV = (H + 2 * KV) * D;
    auto& be = g_.backend_;
    if (g_.llama_)
      be.rope_forward(qkv, g_.rope_.cos.slice(pos_, pos_ + n_), g_.rope_.sin.slice(pos_, pos_ + n_),
                      kernels::AttentionShape{1, n_, H, KV, D, 1.0f});
    const Tensor q = g_.q_.slice(0, n_);
    const Tensor& k_cache = g_.k_cache_[static_cast<size_t>(layer_)];
    const Tensor& v_cache = g_.v_cache_[static_cast<size_t>(layer_)];
    // Split each row into q (attended now) and k, v (appended to the cache).
    for (int64_t i = 0; i < n_; ++i) {
      const float* row = qkv.data<float>() + i * QKV;
      std::memcpy(q.data<float>() + i * H * D, row, sizeof(float) * H * D);
      std::memcpy(k_cache.data<float>() + (pos_ + i) * KV * D, row + H * D, sizeof(float) * KV * D);
      std::memcpy(v_cache.data<float>() + (pos_ + i) * KV * D, row + (H + KV) * D, sizeof(float) * KV * D);
    }
    be.attention_decode(att, q, k_cache, v_cache,
                        kernels::DecodeShape{n_, pos_, H, KV, D, 1.0f / std::sqrt(static_cast<float>(D))});
  }

 private:
  Generator& g_;
  int64_t layer_, pos_, n_;
};

Generator::Generator(spec::TransformerConfig cfg, const ParameterStore& P, kernels::Backend& backend)
    : cfg_(std::move(cfg)),
      backend_(backend),
      llama_(cfg_.arch == spec::Arch::Llama),
      ops_(std::make_unique<kernels::LayerOps>(backend)) {
  if (!P.table().shard().whole())
    throw Error("internal: generation runs on the whole model, not a tensor-parallel shard");
  local_ = local_widths(cfg_, P.table());
  w_ = bind_weights(cfg_, P, local_);
  runner_ = std::make_unique<BlockRunner>(cfg_, backend_, *ops_, /*lowp=*/false);
  const int64_t T = cfg_.max_seq, C = cfg_.d_model, D = cfg_.head_dim(), H = cfg_.n_heads, KV = cfg_.n_kv_heads;
  const int64_t F = cfg_.d_ff, QKV = (H + 2 * KV) * D;
  Allocator& alloc = backend_.allocator();
  auto f32 = [&](Shape s) { return Tensor::empty(s, DType::F32, alloc, MemCategory::Activations); };
  if (llama_) rope_ = make_rope_tables(cfg_, alloc);
  for (int64_t l = 0; l < cfg_.n_layers; ++l) k_cache_.push_back(f32({T, KV * D})), v_cache_.push_back(f32({T, KV * D}));
  // fp32: the GEMM inputs are the f32 tensors themselves.
  auto& a = scratch_;
  a.n1_mean = f32({T}), a.n1_rstd = f32({T}), a.n1_out = a.n1_lp = f32({T, C});
  a.qkv = f32({T, QKV}), a.att = a.att_lp = f32({T, H * D}), a.x_mid = f32({T, C});
  a.n2_mean = a.n1_mean, a.n2_rstd = a.n1_rstd, a.n2_out = a.n2_lp = a.n1_out;
  a.h_pre = f32({T, llama_ ? 2 * F : F}), a.h_act = a.h_act_lp = f32({T, F});
  if (cfg_.moe.enabled()) {
    a.moe = make_moe_activations(cfg_, T, /*lowp=*/false, alloc);
    runner_->moe().set_capacity(false);  // a prompt routes alike however it is fed
  }
  tokens_ = Tensor::empty({1, T}, DType::I32, alloc, MemCategory::Activations);
  x_[0] = f32({T, C}), x_[1] = f32({T, C}), h_ = f32({1, C}), q_ = f32({T, H * D});
  mean_ = f32({1}), rstd_ = f32({1}), logits_ = f32({1, cfg_.vocab_size});
}

Generator::~Generator() = default;

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
  Tensor tok = tokens_.view(0, {1, n});
  std::memcpy(tok.raw(), tokens.data(), sizeof(int32_t) * static_cast<size_t>(n));
  // The first n rows of every scratch tensor.
  const auto& s = scratch_;
  BlockActivations a;
  a.n1_mean = s.n1_mean.slice(0, n), a.n1_rstd = s.n1_rstd.slice(0, n), a.n1_out = a.n1_lp = s.n1_out.slice(0, n);
  a.qkv = s.qkv.slice(0, n), a.att = a.att_lp = s.att.slice(0, n), a.x_mid = s.x_mid.slice(0, n);
  a.n2_mean = a.n1_mean, a.n2_rstd = a.n1_rstd, a.n2_out = a.n2_lp = a.n1_out;
  a.h_pre = s.h_pre.slice(0, n), a.h_act = a.h_act_lp = s.h_act.slice(0, n);
  a.moe = s.moe;  // the MoE layer uses the first n rows
  Tensor x[2] = {x_[0].slice(0, n), x_[1].slice(0, n)};
  if (llama_) {
    ops_->embedding_forward(x[0], tok, w_.wte, nullptr);
  } else {
    Tensor wpe = w_.wpe.slice(pos, pos + n);  // learned positions from the current one
    ops_->embedding_forward(x[0], tok, w_.wte, &wpe);
  }
  int in = 0;
  for (int64_t l = 0; l < cfg_.n_layers; ++l, in ^= 1) {
    CachedAttention attention(*this, l, pos, n);
    runner_->forward(w_.blocks[static_cast<size_t>(l)], a, x[in], x[in ^ 1], attention);
  }
  // Only the last position's logits are needed to pick the next token.
  runner_->norm_forward(w_.norm_f, h_, mean_, rstd_, x[in].slice(n - 1, n));
  ops_->column_forward(logits_, h_, w_.head);
  position_ += n;
  rows_computed_ += n;
  return {logits_.data<float>(), static_cast<size_t>(cfg_.vocab_size)};
}

}  // namespace loom::model
