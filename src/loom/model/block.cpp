#include "loom/model/block.h"

#include "loom/kernels/elementwise.h"
#include "loom/model/fp8_recipe.h"

namespace loom::model {

LocalWidths local_widths(const spec::TransformerConfig& cfg, const spec::ParamTable& table) {
  const int tp = table.shard().tp_size;
  LocalWidths w;
  w.heads = cfg.n_heads / tp;
  w.kv_heads = spec::kv_heads_per_rank(cfg, tp);
  w.d_ff = cfg.d_ff / tp;
  // The vocabulary rows per rank (a pipeline shard without the embedding or a tied head has no such
  // tensor: computed from the placement rule instead, padded to a multiple of tp).
  const char* wte = spec::token_embedding_name(cfg.arch);
  w.vocab = table.index_of(wte) ? table.at(wte).shape[0] : (cfg.vocab_size + tp - 1) / tp;
  w.kv_shared_by = cfg.n_kv_heads >= tp ? 1 : tp / static_cast<int>(cfg.n_kv_heads);
  return w;
}

ModelWeights bind_weights(const spec::TransformerConfig& cfg, const ParameterStore& P, const LocalWidths& local) {
  const bool llama = cfg.arch == spec::Arch::Llama;
  auto linear = [&](const std::string& w, const std::string& b) {
    LinearViews v{P.compute(w), P.grad(w), {}, {}};
    if (!b.empty()) v.b = P.param(b), v.db = P.grad(b);
    return v;
  };
  auto fused = [&](const std::string& first, const std::string& last) {
    return LinearViews{P.compute_rows(first, last), P.grad_rows(first, last), {}, {}};
  };
  // Fewer KV heads than tp: this rank's K and V rows are a piece kv_shared_by ranks hold alike.
  auto with_shared_kv = [&](LinearViews v) {
    if (local.kv_shared_by > 1) {
      const int64_t D = cfg.head_dim();
      v.shared_begin = local.heads * D, v.shared_end = (local.heads + 2 * local.kv_heads) * D;
      v.shared_by = local.kv_shared_by;
    }
    return v;
  };
  // A mixture-of-experts MLP under `prefix` (model/moe_layer.h; spec/param_table.cpp lays it out).
  auto moe = [&](const std::string& prefix) {
    MoeWeights m;
    m.router = {P.param(prefix + "gate.weight"), P.grad(prefix + "gate.weight"), {}, {}};
    if (cfg.moe.bias_update_rate > 0) m.score_bias = P.param(prefix + "gate.e_score_correction_bias");
    const auto [first, last] = spec::local_experts(cfg, P.table().shard());
    for (int64_t e = first; e < last; ++e) {
      const std::string x = prefix + "experts." + std::to_string(e) + ".";
      const LinearViews gate_up = fused(x + "w1.weight", x + "w3.weight"), down = linear(x + "w2.weight", "");
      m.gate_up.push_back(gate_up.w), m.gate_up_grad.push_back(gate_up.dw);
      m.down.push_back(down.w), m.down_grad.push_back(down.dw);
    }
    if (cfg.moe.shared_experts > 0) {
      m.shared_gate_up = fused(prefix + "shared_experts.gate_proj.weight", prefix + "shared_experts.up_proj.weight");
      m.shared_down = linear(prefix + "shared_experts.down_proj.weight", "");
    }
    return m;
  };
  auto norm = [&](const std::string& prefix) {
    NormViews n{P.param(prefix + ".weight"), P.grad(prefix + ".weight"), {}, {}};
    if (!llama) n.b = P.param(prefix + ".bias"), n.db = P.grad(prefix + ".bias");
    return n;
  };
  // A pipeline shard binds what it holds; the rest stays empty (never run here).
  const auto& shard = P.table().shard();
  auto has = [&](const std::string& name) { return P.table().index_of(name).has_value(); };
  ModelWeights m;
  m.blocks.resize(static_cast<size_t>(cfg.n_layers));
  if (llama) {
    if (has("model.embed_tokens.weight"))
      m.wte = P.param("model.embed_tokens.weight"), m.dwte = P.grad("model.embed_tokens.weight");
    for (int64_t l = 0; l < cfg.n_layers; ++l) {
      if (!shard.holds_block(l)) continue;
      const std::string p = "model.layers." + std::to_string(l) + ".";
      BlockWeights& b = m.blocks[static_cast<size_t>(l)];
      b.norm1 = norm(p + "input_layernorm"), b.norm2 = norm(p + "post_attention_layernorm");
      b.qkv = with_shared_kv(fused(p + "self_attn.q_proj.weight", p + "self_attn.v_proj.weight"));
      b.out = linear(p + "self_attn.o_proj.weight", "");
      if (cfg.is_moe_layer(l)) {
        b.moe = moe(spec::moe_param_prefix(cfg, l));
      } else {
        b.up = fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight");
        b.down = linear(p + "mlp.down_proj.weight", "");
      }
    }
    if (shard.head) {
      m.norm_f = norm("model.norm");
      m.head = cfg.tie_embeddings ? linear("model.embed_tokens.weight", "") : linear("lm_head.weight", "");
    }
  } else {
    if (has("transformer.wte.weight"))
      m.wte = P.param("transformer.wte.weight"), m.dwte = P.grad("transformer.wte.weight");
    if (has("transformer.wpe.weight"))
      m.wpe = P.param("transformer.wpe.weight"), m.dwpe = P.grad("transformer.wpe.weight");
    for (int64_t l = 0; l < cfg.n_layers; ++l) {
      if (!shard.holds_block(l)) continue;
      const std::string p = "transformer.h." + std::to_string(l) + ".";
      BlockWeights& b = m.blocks[static_cast<size_t>(l)];
      b.norm1 = norm(p + "ln_1"), b.norm2 = norm(p + "ln_2");
      b.qkv = linear(p + "attn.c_attn.weight", p + "attn.c_attn.bias");
      b.out = linear(p + "attn.c_proj.weight", p + "attn.c_proj.bias");
      if (cfg.is_moe_layer(l)) {
        b.moe = moe(spec::moe_param_prefix(cfg, l));
      } else {
        b.up = linear(p + "mlp.c_fc.weight", p + "mlp.c_fc.bias");
        b.down = linear(p + "mlp.c_proj.weight", p + "mlp.c_proj.bias");
      }
    }
    if (shard.head) {
      m.norm_f = norm("transformer.ln_f");
      m.head = cfg.tie_embeddings ? linear("transformer.wte.weight", "") : linear("lm_head.weight", "");
    }
  }
  return m;
}

RopeTables make_rope_tables(const spec::TransformerConfig& cfg, Allocator& alloc) {
  const int64_t D = cfg.head_dim();
  RopeTables r{Tensor::empty({cfg.max_seq, D / 2}, DType::F32, alloc, MemCategory::Activations),
               Tensor::empty({cfg.max_seq, D / 2}, DType::F32, alloc, MemCategory::Activations)};
  kernels::rope_tables(r.cos.data<float>(), r.sin.data<float>(), cfg.max_seq, D, cfg.rope_theta);
  return r;
}

BlockRunner::BlockRunner(const spec::TransformerConfig& cfg, kernels::Backend& backend, kernels::LayerOps& ops,
                         bool lowp)
    : cfg_(cfg), be_(backend), ops_(ops), llama_(cfg.arch == spec::Arch::Llama), lowp_(lowp), moe_(cfg, backend, lowp, &ops) {}

void BlockRunner::to_gemm_input(const Tensor& lp, const Tensor& f32) {
  if (lowp_) be_.cast(lp, f32);
}

void BlockRunner::to_gemm_input(const Tensor& lp, const Tensor& f32, int64_t layer, Fp8Linear k) {
  if (fp8_ && layer >= 0)
    fp8_->quantize_input(layer, k, lp, f32);
  else
    to_gemm_input(lp, f32);
}

BlockWeights BlockRunner::gemm_weights(int64_t layer, const BlockWeights& w) const {
  return fp8_ && layer >= 0 ? fp8_->weights(layer, w) : w;
}

void BlockRunner::norm_forward(const NormViews& n, const Tensor& out, const Tensor& mean, const Tensor& rstd,
                               const Tensor& x) {
  if (llama_)
    be_.rmsnorm_forward(out, rstd, x, n.w, cfg_.norm_eps);
  else
    be_.layernorm_forward(out, mean, rstd, x, n.w, n.b, cfg_.norm_eps);
}

void BlockRunner::norm_backward(const NormViews& n, const Tensor& dx, const Tensor& dout, const Tensor& x,
                                const Tensor& mean, const Tensor& rstd) {
  if (llama_)
    be_.rmsnorm_backward(dx, n.dw, dout, x, n.w, rstd);
  else
    be_.layernorm_backward(dx, n.dw, n.db, dout, x, n.w, mean, rstd);
}

void BlockRunner::forward(const BlockWeights& weights, BlockActivations& a, const Tensor& x_in, const Tensor& x_out,
                          AttentionStep& attention, int64_t layer, MoeLoad* moe_load, MoeScratch* moe_scratch) {
  const BlockWeights w = gemm_weights(layer, weights);
  // attention sub-layer: x_mid = x_in + out_proj(attention(qkv(norm1(x_in)))); qkv column-parallel
  // (this rank's heads), out_proj row-parallel.
  norm_forward(w.norm1, a.n1_out, a.n1_mean, a.n1_rstd, x_in);
  to_gemm_input(a.n1_lp, a.n1_out, layer, Fp8Linear::Qkv);
  ops_.column_forward(a.qkv, a.n1_lp, w.qkv);
  attention.forward(a.att, a.lse, a.qkv);
  to_gemm_input(a.att_lp, a.att, layer, Fp8Linear::Out);
  ops_.row_forward_add(a.x_mid, x_in, a.att_lp, w.out);
  // MLP sub-layer: x_out = x_mid + down(act(up(norm2(x_mid)))); up column-, down row-parallel.
  norm_forward(w.norm2, a.n2_out, a.n2_mean, a.n2_rstd, a.x_mid);
  to_gemm_input(a.n2_lp, a.n2_out, layer, Fp8Linear::Up);
  if (w.moe.defined()) {
    // Mixture of experts: x_out = x_mid + moe(norm2(x_mid)).
    x_out.copy_from(a.x_mid);
    moe_.forward(w.moe, a.moe, a.n2_lp, a.n2_out, x_out, moe_load, moe_scratch);
    return;
  }
  ops_.column_forward(a.h_pre, a.n2_lp, w.up);
  // In bf16 the activation writes the down projection's bf16 input directly (its f32 value has no
  // other reader); fp8 quantises from the f32 value instead.
  const bool fused_cast = lowp_ && !(fp8_ && layer >= 0);
  const Tensor& act_out = fused_cast ? a.h_act_lp : a.h_act;
  if (llama_)
    be_.swiglu_forward(act_out, a.h_pre);
  else
    be_.gelu_forward(act_out, a.h_pre);
  if (!fused_cast) to_gemm_input(a.h_act_lp, a.h_act, layer, Fp8Linear::Down);
  ops_.row_forward_add(x_out, a.x_mid, a.h_act_lp, w.down);
}

}  // namespace loom::model
