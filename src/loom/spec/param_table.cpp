#include "loom/spec/param_table.h"

#include <algorithm>

#include <cmath>

#include "loom/error.h"

namespace loom::spec {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw ConfigError("parameter '" + name + "' has a shape whose size does not fit in 64 bits");
  return n;
}

namespace {
// The block index in a Hugging Face name ("transformer.h.3.attn..." / "model.layers.3.mlp..."), or -1.
int64_t block_of(const std::string& name) {
  for (const char* key : {".h.", ".layers."}) {
    auto at = name.find(key);
    if (at == std::string::npos) continue;
    size_t i = at + std::char_traits<char>::length(key);
    int64_t v = 0;
    bool digits = false;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i, digits = true) v = v * 10 + (name[i] - '0');
    if (digits && i < name.size() && name[i] == '.') return v;
  }
  return -1;
}
}  // namespace

std::vector<int64_t> ParamTable::block_starts(int64_t n_layers) const {
  std::vector<int64_t> starts(n_layers + 1, total_);
  int64_t blocks_end = 0;
  for (const auto& p : params_) {
    const int64_t b = block_of(p.name);
    if (b >= 0 && b < n_layers) {
      starts[b] = std::min(starts[b], p.offset);
      blocks_end = std::max(blocks_end, p.offset + p.numel());
    }
  }
  starts[n_layers] = blocks_end;
  return starts;
}

void ParamTable::add(ParamSpec p) {
  // A hash index keeps building the table linear in the number of tensors.
  if (!index_.emplace(p.name, params_.size()).second) throw ConfigError("parameter '" + p.name + "' defined twice");
  // Keep every tensor 64-byte aligned in an f32 arena so vector kernels can assume it.
  const int64_t numel = p.numel();
  total_ = (total_ + 15) / 16 * 16;
  p.offset = total_;
  if (__builtin_add_overflow(total_, numel, &total_))
    throw ConfigError("the parameter table's size overflows 64 bits at '" + p.name + "'");
  params_.push_back(std::move(p));
}

int64_t ParamTable::non_embedding_numel() const {
  int64_t n = 0;
  for (auto& p : params_)
    if (p.name != "transformer.wte.weight" && p.name != "transformer.wpe.weight" &&
        p.name != "model.embed_tokens.weight" && p.name != "lm_head.weight")
      n += p.numel();
  return n;
}

std::optional<size_t> ParamTable::index_of(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

const ParamSpec& ParamTable::at(const std::string& name) const {
  auto i = index_of(name);
  if (!i) throw ConfigError("no parameter named '" + name + "' in this model");
  return params_[*i];
}

namespace {

ParamSpec matrix(std::string name, int64_t out, int64_t in, float std) {
  return {std::move(name), {out, in}, {Init::Kind::Normal, std}, Placement::replicate(), true, 0};
}
// A matrix only GEMMs read (not an embedding table).
ParamSpec linear(std::string name, int64_t out, int64_t in, float std) {
  ParamSpec p = matrix(std::move(name), out, in, std);
  p.gemm_only = true;
  return p;
}
ParamSpec vec(std::string name, int64_t n, Init::Kind kind) {
  return {std::move(name), {n}, {kind, 0.0f}, Placement::replicate(), false, 0};
}

void add_gpt2(ParamTable& t, const TransformerConfig& c) {
  const int64_t C = c.d_model;
  // GPT-2 scales the init of projections that write into the residual stream by 1/sqrt(2L),
  // so the residual's variance does not grow with depth.
  const float resid_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers));
  t.add(matrix("transformer.wte.weight", c.vocab_size, C, c.init_std));
  t.add(matrix("transformer.wpe.weight", c.max_seq, C, c.init_std));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    std::string p = "transformer.h." + std::to_string(l) + ".";
    t.add(vec(p + "ln_1.weight", C, Init::Kind::Ones));
    t.add(vec(p + "ln_1.bias", C, Init::Kind::Zeros));
    t.add(linear(p + "attn.c_attn.weight", 3 * C, C, c.init_std));
    t.add(vec(p + "attn.c_attn.bias", 3 * C, Init::Kind::Zeros));
    t.add(linear(p + "attn.c_proj.weight", C, C, resid_std));
    t.add(vec(p + "attn.c_proj.bias", C, Init::Kind::Zeros));
    t.add(vec(p + "ln_2.weight", C, Init::Kind::Ones));
    t.add(vec(p + "ln_2.bias", C, Init::Kind::Zeros));
    t.add(linear(p + "mlp.c_fc.weight", c.d_ff, C, c.init_std));
    t.add(vec(p + "mlp.c_fc.bias", c.d_ff, Init::Kind::Zeros));
    t.add(linear(p + "mlp.c_proj.weight", C, c.d_ff, resid_std));
    t.add(vec(p + "mlp.c_proj.bias", C, Init::Kind::Zeros));
  }
  t.add(vec("transformer.ln_f.weight", C, Init::Kind::Ones));
  t.add(vec("transformer.ln_f.bias", C, Init::Kind::Zeros));
  if (!c.tie_embeddings) t.add(linear("lm_head.weight", c.vocab_size, C, c.init_std));
}

void add_llama(ParamTable& t, const TransformerConfig& c) {
  const int64_t C = c.d_model, hd = c.head_dim();
  const float resid_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers));
  t.add(matrix("model.embed_tokens.weight", c.vocab_size, C, c.init_std));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    t.add(vec(p + "input_layernorm.weight", C, Init::Kind::Ones));
    t.add(linear(p + "self_attn.q_proj.weight", c.n_heads * hd, C, c.init_std));
    t.add(linear(p + "self_attn.k_proj.weight", c.n_kv_heads * hd, C, c.init_std));
    t.add(linear(p + "self_attn.v_proj.weight", c.n_kv_heads * hd, C, c.init_std));
    t.add(linear(p + "self_attn.o_proj.weight", C, c.n_heads * hd, resid_std));
    t.add(vec(p + "post_attention_layernorm.weight", C, Init::Kind::Ones));
    t.add(linear(p + "mlp.gate_proj.weight", c.d_ff, C, c.init_std));
    t.add(linear(p + "mlp.up_proj.weight", c.d_ff, C, c.init_std));
    t.add(linear(p + "mlp.down_proj.weight", C, c.d_ff, resid_std));
  }
  t.add(vec("model.norm.weight", C, Init::Kind::Ones));
  if (!c.tie_embeddings) t.add(linear("lm_head.weight", c.vocab_size, C, c.init_std));
}

}  // namespace

ParamTable build_param_table(const TransformerConfig& cfg) {
  cfg.validate();
  ParamTable t;
  if (cfg.arch == Arch::GPT2)
    add_gpt2(t, cfg);
  else
    add_llama(t, cfg);
  return t;
}

}  // namespace loom::spec
