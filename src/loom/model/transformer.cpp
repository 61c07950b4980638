#include "loom/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/error.h"
#include "loom/kernels/elementwise.h"
#include "loom/model/fp8_recipe.h"
#include "loom/profile/tracer.h"
#include "loom/spec/context_parallel.h"

namespace loom::model {

using spec::Arch;

namespace {

// Training attends over the whole micro-batch: rotary embedding in place (Llama, at the tokens' global
// positions), causal attention through the attention ops (here, or across the context-parallel group),
// the softmax statistics kept for backward.
class WholeSequence final : public AttentionStep {
 public:
  WholeSequence(kernels::Backend& be, kernels::AttentionOps& ops, RopeTables rope, bool llama,
                const kernels::AttentionShape& s)
      : be_(be), ops_(ops), rope_(std::move(rope)), llama_(llama), s_(s) {}
  void forward(const Tensor& att, const Tensor& lse, const Tensor& qkv) override {
    if (llama_) be_.rope_forward(qkv, rope_.cos, rope_.sin, s_);
    ops_.forward(att, lse, qkv, s_);
  }

 private:
  kernels::Backend& be_;
  kernels::AttentionOps& ops_;
  RopeTables rope_;
  bool llama_;
  kernels::AttentionShape s_;
};

// The rotary tables a context's tokens read: its own rows at its positions under context parallelism.
RopeTables rope_of(const ActivationContext& c, const RopeTables& whole) {
  return c.rope_cos.defined() ? RopeTables{c.rope_cos, c.rope_sin} : whole;
}

// dst row t = src row rows[t] (rows of `width` elements of src's dtype).
void gather_rows(const Tensor& dst, const Tensor& src, const std::vector<int32_t>& rows, int64_t width) {
  const size_t bytes = static_cast<size_t>(width) * dtype_size(src.dtype());
  for (size_t t = 0; t < rows.size(); ++t)
    std::memcpy(static_cast<std::byte*>(dst.raw()) + t * bytes,
                static_cast<const std::byte*>(src.raw()) + static_cast<size_t>(rows[t]) * bytes, bytes);
}

}  // namespace

Transformer::Transformer(spec::TransformerConfig cfg, ParameterStore& params, kernels::Backend& backend,
                         kernels::LayerOps* ops, spec::Recompute recompute, kernels::AttentionOps* attention,
                         kernels::ExpertExchange* experts)
    : cfg_(std::move(cfg)),
      params_(params),
      own_ops_(ops ? nullptr : std::make_unique<kernels::LayerOps>(backend)),
      ops_(ops ? ops : own_ops_.get()),
      own_attention_(attention ? nullptr : std::make_unique<kernels::AttentionOps>(backend)),
      attention_(attention ? attention : own_attention_.get()),
      backend_(backend),
      recompute_(recompute),
      llama_(cfg_.arch == Arch::Llama),
      lowp_(params.precision() == Precision::BF16),
      runner_(cfg_, backend, *ops_, lowp_) {
  cfg_.validate();
  const auto& shard = params_.table().shard();
  if (ops_->size() != shard.tp_size || ops_->rank() != shard.tp_rank)
    throw Error("internal: the parameter table is tp rank " + std::to_string(shard.tp_rank) + " of " +
                std::to_string(shard.tp_size) + " but the layer ops are rank " + std::to_string(ops_->rank()) + " of " +
                std::to_string(ops_->size()));
  if (experts && experts->size() != params_.table().shard().ep_size)
    throw Error("internal: the parameter table splits the experts over " + std::to_string(params_.table().shard().ep_size) +
                " ranks but the expert exchange has " + std::to_string(experts->size()));
  runner_.moe().set_exchange(experts && experts->size() > 1 ? experts : nullptr);
  local_ = local_widths(cfg_, params_.table());
  w_ = bind_weights(cfg_, params_, local_);
  if (llama_) rope_ = make_rope_tables(cfg_, backend_.allocator());
  moe_load_.resize(static_cast<size_t>(cfg_.n_layers));
}

void Transformer::reset_moe_load() {
  for (auto& l : moe_load_) l = MoeLoad{};
}

kernels::AttentionShape Transformer::attention_shape(int64_t B, int64_t T) const {
  return {B, T, local_.heads, local_.kv_heads, cfg_.head_dim(), 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim())),
          lowp_};
}

ActivationContext Transformer::make_context(int64_t B, int64_t T) const {
  return make_context(B, T, {0, cfg_.n_layers, true, true});
}

ActivationContext Transformer::make_context(int64_t B, int64_t T, const Chunk& ch, bool split_backward) const {
  check_chunk(ch);
  if (split_backward && recompute_ != spec::Recompute::None)
    throw UnsupportedError("a split (zero-bubble) backward cannot run with recompute = " +
                           std::string(spec::recompute_name(recompute_)) +
                           ": its weight pass reads GEMM inputs that recompute does not keep");
  const int cp = attention_->size();
  if (B <= 0 || T <= 0 || T * cp > cfg_.max_seq)
    throw ConfigError("micro-batch [" + std::to_string(B) + ", " + std::to_string(T) +
                      "] is invalid: need B > 0 and 0 < T <= model.max_seq = " + std::to_string(cfg_.max_seq) +
                      (cp > 1 ? " (T is this rank's tokens: " + std::to_string(T) + " x cp = " + std::to_string(cp) +
                                    " per sample)"
                              : std::string()));
  Allocator& alloc = backend_.allocator();
  const auto act = MemCategory::Activations;
  const int64_t N = B * T, C = cfg_.d_model, D = cfg_.head_dim(), H = local_.heads, KV = local_.kv_heads;
  const int64_t F = local_.d_ff, QKV = (H + 2 * KV) * D, HPRE = llama_ ? 2 * F : F;
  // The residual stream's rows this rank holds: all N, or N / tp under sequence parallelism.
  const int64_t S = ops_->sequence_shards();
  if (N % S != 0)
    throw ConfigError("sequence parallelism over " + std::to_string(S) + " ranks cannot split a micro-batch of " +
                      std::to_string(B) + " x " + std::to_string(T) + " token rows evenly");
  const int64_t R = N / S;
  auto f32 = [&](Shape s) { return Tensor::empty(s, DType::F32, alloc, act); };
  // In bf16 mode GEMM inputs get their own bf16 copy; in fp32 mode the copy is the tensor itself.
  auto lp = [&](const Tensor& t) { return lowp_ ? Tensor::empty(t.shape(), DType::BF16, alloc, act) : t; };
  ActivationContext c;
  c.B = B, c.T = T;
  if (cp > 1) {
    spec::validate_context_parallel(cfg_, T * cp, cp, spec::CpMode::Ring);  // the chunks must split
    c.positions = spec::context_positions(T * cp, cp, attention_->rank());
    if (llama_) {
      const int64_t half = D / 2;
      c.rope_cos = f32({T, half}), c.rope_sin = f32({T, half});
      gather_rows(c.rope_cos, rope_.cos, c.positions, half);
      gather_rows(c.rope_sin, rope_.sin, c.positions, half);
    } else if (ch.embeddings) {
      c.wpe_rows = Tensor::empty({T, C}, w_.wpe.dtype(), alloc, act);
      c.dwpe_rows = f32({T, C});
    }
  }
  c.tokens = Tensor::empty({B, T}, DType::I32, alloc, act);
  c.targets = Tensor::empty({B, T}, DType::I32, alloc, act);
  // Only the chunk's blocks save anything; the residual stream from its input to its output.
  const int64_t L = cfg_.n_layers;
  const bool heads = ch.head;
  c.residual.resize(static_cast<size_t>(L + 1));
  for (int64_t l = ch.first; l <= ch.last; ++l) c.residual[static_cast<size_t>(l)] = f32({R, C});
  // In bf16 mode the f32 outputs of the norms and the MLP activation only feed a cast to the bf16 copy
  // that GEMMs and backward read, so every layer writes them into one shared scratch. In fp32 mode
  // they are the saved tensors themselves and each layer keeps its own.
  Tensor scratch = lowp_ ? f32({std::max(R * C, N * F)}) : Tensor();
  auto f32_or_scratch = [&](Shape s) { return lowp_ ? scratch.view(0, s) : f32(s); };
  // What a block saves; under recompute, what it does not keep is one set every block of the chunk
  // shares (forward overwrites it block after block, backward refills it for the block at hand).
  c.recompute = recompute_;
  auto attention_core = [&](BlockActivations& a) {
    a.lse = f32({B, H, T}), a.att = f32({N, H * D}), a.att_lp = lp(a.att);
  };
  bool chunk_moe = false, chunk_dense = false;
  for (int64_t l = ch.first; l < ch.last; ++l) (cfg_.is_moe_layer(l) ? chunk_moe : chunk_dense) = true;
  if (split_backward && chunk_moe)
    throw UnsupportedError("a split (zero-bubble) backward cannot run mixture-of-experts blocks yet");
  auto block = [&](BlockActivations& a, bool core, bool dense_mlp, bool moe_mlp) {
    a.n1_mean = f32({R}), a.n1_rstd = f32({R}), a.n1_out = f32_or_scratch({R, C}), a.n1_lp = lp(a.n1_out);
    a.qkv = f32({N, QKV});
    if (core) attention_core(a);
    a.x_mid = f32({R, C});
    // A mixture-of-experts block keeps norm2's f32 output: its router reads it in backward too.
    a.n2_mean = f32({R}), a.n2_rstd = f32({R}), a.n2_out = moe_mlp ? f32({R, C}) : f32_or_scratch({R, C});
    a.n2_lp = lp(a.n2_out);
    if (dense_mlp) a.h_pre = f32({N, HPRE}), a.h_act = f32_or_scratch({N, F}), a.h_act_lp = lp(a.h_act);
    if (moe_mlp) a.moe = make_moe_activations(cfg_, N, lowp_, alloc, runner_.moe().split());
  };
  c.blocks.resize(static_cast<size_t>(L));
  if (ch.last > ch.first) {
    BlockActivations shared;
    if (recompute_ == spec::Recompute::Full) {
      block(shared, true, chunk_dense, chunk_moe);
      c.recompute_out = f32({R, C});
    } else if (recompute_ == spec::Recompute::Selective) {
      attention_core(shared);
    }
    for (int64_t l = ch.first; l < ch.last; ++l) {
      BlockActivations& a = c.blocks[static_cast<size_t>(l)];
      if (recompute_ == spec::Recompute::Full) {
        a = shared;
        continue;
      }
      block(a, recompute_ == spec::Recompute::None, !cfg_.is_moe_layer(l), cfg_.is_moe_layer(l));
      if (recompute_ == spec::Recompute::Selective) a.lse = shared.lse, a.att = shared.att, a.att_lp = shared.att_lp;
    }
  }
  if (heads) {
    c.nf_mean = f32({R}), c.nf_rstd = f32({R}), c.nf_out = f32_or_scratch({R, C}), c.nf_lp = lp(c.nf_out);
    c.logits = f32({N, local_.vocab});
    c.losses = f32({N});
  }
  c.d_res = f32({R, C}), c.d_norm = f32({R, C}), c.d_att = f32({N, H * D}), c.d_qkv = f32({N, QKV});
  if (runner_.fp8() && ch.last > ch.first) c.fp8_dy = f32({std::max({R * C, N * HPRE, N * QKV})});
  if (S > 1) c.norm_grads = f32({4 * C});
  c.d_h_act = f32({N, F}), c.d_h_pre = f32({N, HPRE});
  if (chunk_moe) c.moe = make_moe_scratch(cfg_, N, lowp_, alloc, runner_.moe().split());
  if (split_backward) {
    c.split.resize(static_cast<size_t>(L));
    for (int64_t l = ch.first; l < ch.last; ++l)
      c.split[static_cast<size_t>(l)] = {f32({R, C}), f32({N, HPRE}), f32({R, C}), f32({N, QKV})};
  }
  return c;
}

void Transformer::block_backward(int64_t layer, const BlockWeights& weights, BlockActivations& a, ActivationContext& c,
                                 const Tensor& x_in, const kernels::AttentionShape& s, BlockOutputGrads* split) {
  auto& be = backend_;
  auto& ops = *ops_;
  const BlockWeights blk = runner_.gemm_weights(layer, weights);
  Fp8Recipe* fp8 = runner_.fp8();
  // Split: the four linears compute their input gradients only, and their output gradients stay in
  // `split` for the weight pass (the residual stream's gradient is copied: the norms' backward adds
  // into it). Whole: each linear computes both (row- or column-parallel as the op interface has it).
  const Tensor& d_h_pre = split ? split->up : c.d_h_pre;
  const Tensor& d_qkv = split ? split->qkv : c.d_qkv;
  auto linear_backward = [&](const Tensor& dx, const kernels::LinearWeights& lin, const Tensor& dy_in, const Tensor& x,
                             bool row, const Tensor* keep_dy, Fp8Linear k) {
    // fp8: the GEMMs read the output gradient quantised (into a buffer: dy itself flows on, e.g. the
    // residual stream's gradient); the bias gradient is summed from it too.
    Tensor dy = dy_in;
    if (fp8) {
      dy = c.fp8_dy.view(0, dy_in.shape());
      fp8->quantize_output_grad(layer, k, dy, dy_in);
    }
    if (split) {
      if (keep_dy) keep_dy->copy_from(dy);
      ops.linear_backward_input(dx, lin, dy, x);
    } else if (row) {
      ops.row_backward(dx, lin, dy, x);
    } else {
      ops.column_backward(&dx, lin, dy, x);
    }
  };
  attention_->prepare_backward(a.qkv, s);  // context parallelism: K/V start around the ring now
  // c.d_res holds d(loss)/d(x_out) and becomes d(loss)/d(x_in): each norm backward adds its branch.
  if (blk.moe.defined()) {
    if (split) throw Error("internal: a split backward reached a mixture-of-experts block");
    runner_.moe().backward(blk.moe, a.moe, c.moe, c.d_res, c.d_norm, a.n2_lp, a.n2_out, c.moe_aux_scale);
  } else {
    linear_backward(c.d_h_act, blk.down, c.d_res, a.h_act_lp, true, split ? &split->down : nullptr, Fp8Linear::Down);
    if (!fp8 && !split && blk.up.shared_by == 1) {
      // The activation's backward prepares the up projection's output gradient in the same pass (in bf16:
      // rounded, with GELU's bias gradient), so no f32 copy of it is written and read again.
      const Tensor g = be.activation_backward_output_grad(
          llama_ ? kernels::Activation::SwiGLU : kernels::Activation::Gelu, d_h_pre, a.h_pre, c.d_h_act,
          blk.up.has_bias() ? &blk.up.db : nullptr, blk.up.w);
      kernels::LinearWeights up = blk.up;
      up.b = up.db = Tensor();  // its gradient is in already
      ops.column_backward(&c.d_norm, up, g, a.n2_lp);
    } else {
      if (llama_)
        be.swiglu_backward(d_h_pre, a.h_pre, c.d_h_act);
      else
        be.gelu_backward(d_h_pre, a.h_pre, c.d_h_act);
      linear_backward(c.d_norm, blk.up, d_h_pre, a.n2_lp, false, nullptr, Fp8Linear::Up);
    }
  }
  if (c.norm_grads.defined()) c.norm_grads.fill_zero();
  runner_.norm_backward(partial_grads(blk.norm2, c, 0), c.d_res, c.d_norm, a.x_mid, a.n2_mean, a.n2_rstd);

  linear_backward(c.d_att, blk.out, c.d_res, a.att_lp, true, split ? &split->out : nullptr, Fp8Linear::Out);
  attention_->backward(d_qkv, c.d_att, a.att, a.lse, a.qkv, s);
  if (llama_) {
    const RopeTables rope = rope_of(c, rope_);
    be.rope_backward(d_qkv, rope.cos, rope.sin, s);
  }
  linear_backward(c.d_norm, blk.qkv, d_qkv, a.n1_lp, false, nullptr, Fp8Linear::Qkv);
  runner_.norm_backward(partial_grads(blk.norm1, c, 1), c.d_res, c.d_norm, x_in, a.n1_mean, a.n1_rstd);
  add_partial_grads({&blk.norm2, &blk.norm1}, c);
}

void Transformer::recompute_block(int64_t l, ActivationContext& c, const kernels::AttentionShape& s) {
  if (c.recompute == spec::Recompute::None) return;
  // The recomputed forward is the forward's own code on the same inputs and weights: its tensors are
  // bitwise the ones forward wrote (tests hold fp32 losses and gradients to that).
  profile::ScopedSpanContext where(static_cast<int>(l), "R");
  BlockActivations& a = c.blocks[static_cast<size_t>(l)];
  if (c.recompute == spec::Recompute::Full) {
    WholeSequence attention(backend_, *attention_, rope_of(c, rope_), llama_, s);
    runner_.forward(w_.blocks[static_cast<size_t>(l)], a, c.residual[static_cast<size_t>(l)], c.recompute_out,
                    attention, l, nullptr, &c.moe);
  } else {
    // qkv was saved after the rotary embedding: only the attention core runs again.
    attention_->recompute(a.att, a.lse, a.qkv, s);
    runner_.to_gemm_input(a.att_lp, a.att, l, Fp8Linear::Out);
  }
}

void Transformer::block_backward_weight(const BlockWeights& blk, const BlockActivations& a, const BlockOutputGrads& g) {
  auto& ops = *ops_;
  ops.linear_backward_weight(blk.down, g.down, a.h_act_lp);
  ops.linear_backward_weight(blk.up, g.up, a.n2_lp);
  ops.linear_backward_weight(blk.out, g.out, a.att_lp);
  ops.linear_backward_weight(blk.qkv, g.qkv, a.n1_lp);
}

NormViews Transformer::partial_grads(const NormViews& n, ActivationContext& c, int slot) const {
  if (!c.norm_grads.defined()) return n;
  const int64_t C = cfg_.d_model;
  NormViews v = n;
  v.dw = c.norm_grads.view(2 * slot * C, {C});
  if (n.db.defined()) v.db = c.norm_grads.view((2 * slot + 1) * C, {C});
  return v;
}

void Transformer::add_partial_grads(std::initializer_list<const NormViews*> norms, ActivationContext& c) {
  if (!c.norm_grads.defined()) return;
  const int64_t C = cfg_.d_model;
  ops_->sum_partial_grads(c.norm_grads.view(0, {2 * static_cast<int64_t>(norms.size()) * C}));
  int slot = 0;
  for (const NormViews* n : norms) {
    backend_.add(n->dw, n->dw, c.norm_grads.view(2 * slot * C, {C}));
    if (n->db.defined()) backend_.add(n->db, n->db, c.norm_grads.view((2 * slot + 1) * C, {C}));
    ++slot;
  }
}

const Tensor* Transformer::position_rows(ActivationContext& c) const {
  if (llama_) return nullptr;
  if (!c.wpe_rows.defined()) return &w_.wpe;
  gather_rows(c.wpe_rows, w_.wpe, c.positions, cfg_.d_model);  // the weights changed since the last step
  return &c.wpe_rows;
}

void Transformer::add_position_grads(ActivationContext& c) {
  if (!c.dwpe_rows.defined()) return;
  const int64_t C = cfg_.d_model;
  float* dwpe = w_.dwpe.data<float>();
  const float* rows = c.dwpe_rows.data<float>();
  for (size_t t = 0; t < c.positions.size(); ++t) {
    float* dst = dwpe + static_cast<int64_t>(c.positions[t]) * C;
    const float* src = rows + static_cast<int64_t>(t) * C;
    for (int64_t k = 0; k < C; ++k) dst[k] += src[k];
  }
}

double Transformer::forward(ActivationContext& c, const Tensor& tokens, const Tensor& targets, float grad_scale) {
  return forward_chunk(c, {0, cfg_.n_layers, true, true}, &tokens, &targets, grad_scale);
}

void Transformer::backward(ActivationContext& c) { backward_chunk(c, {0, cfg_.n_layers, true, true}); }

void Transformer::check_chunk(const Chunk& ch) const {
  const auto& shard = params_.table().shard();
  bool held = ch.first >= 0 && ch.first <= ch.last && ch.last <= cfg_.n_layers;
  for (int64_t l = ch.first; held && l < ch.last; ++l) held = shard.holds_block(l);
  if (!held || (ch.embeddings && (ch.first != 0 || !shard.embeddings)) ||
      (ch.head && (ch.last != cfg_.n_layers || !shard.head)))
    throw Error("internal: blocks [" + std::to_string(ch.first) + ", " + std::to_string(ch.last) +
                ") are not all in this rank's shard of the model");
}

double Transformer::forward_chunk(ActivationContext& c, const Chunk& ch, const Tensor* tokens, const Tensor* targets,
                                  float grad_scale) {
  check_chunk(ch);
  const int64_t L = cfg_.n_layers;
  const bool embeds = ch.embeddings, heads = ch.head;
  auto check = [&](const Tensor* t, const char* what) {
    if (!t || t->shape() != Shape({c.B, c.T}) || t->dtype() != DType::I32)
      throw ShapeError(std::string("forward: ") + what + " must be I32 [" + std::to_string(c.B) + ", " +
                       std::to_string(c.T) + "]" + (t ? ", got " + t->shape().str() : ""));
  };
  // The chunk with the embeddings reads the tokens, the one with the head the targets; each checks its own.
  if (embeds) {
    check(tokens, "tokens");
    c.tokens.copy_from(*tokens);
    const int32_t* tk = c.tokens.data<int32_t>();
    for (int64_t i = 0; i < c.tokens.numel(); ++i)
      if (tk[i] < 0 || tk[i] >= cfg_.vocab_size)
        throw ConfigError("token id " + std::to_string(tk[i]) + " at position " + std::to_string(i) +
                          " is outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) +
                          "): the data does not match model.vocab_size");
  }
  if (heads) {
    check(targets, "targets");
    c.targets.copy_from(*targets);
    const int32_t* tg = c.targets.data<int32_t>();
    c.valid_targets = 0;
    for (int64_t i = 0; i < c.targets.numel(); ++i) {
      if (tg[i] >= cfg_.vocab_size)
        throw ConfigError("token id " + std::to_string(tg[i]) + " at position " + std::to_string(i) +
                          " is outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) +
                          "): the data does not match model.vocab_size");
      c.valid_targets += tg[i] >= 0;
    }
  }
  WholeSequence attention(backend_, *attention_, rope_of(c, rope_), llama_, attention_shape(c.B, c.T));
  // The load-balancing loss enters the gradient like the tokens' losses: by this micro-batch's share of
  // the step's tokens (grad_scale is 1 / the step's tokens).
  c.moe_aux_scale = cfg_.moe.aux_loss_coef * static_cast<double>(c.B * c.T) * grad_scale;
  LayerHooks none;
  LayerHooks& h = hooks_ ? *hooks_ : none;
  if (embeds) {
    profile::ScopedSpanContext where(-1, "F");
    h.before_forward(-1);
    ops_->embedding_forward(c.residual[0], c.tokens, w_.wte, position_rows(c));
    h.after_forward(-1);
  }
  for (int64_t l = ch.first; l < ch.last; ++l) {
    profile::ScopedSpanContext where(static_cast<int>(l), "F");
    h.before_forward(l);
    runner_.forward(w_.blocks[l], c.blocks[l], c.residual[l], c.residual[l + 1], attention, l,
                    grad_scale > 0 ? &moe_load_[static_cast<size_t>(l)] : nullptr, &c.moe);
    h.after_forward(l);
  }
  if (!heads) return 0.0;
  profile::ScopedSpanContext where(static_cast<int>(L), "F");
  h.before_forward(L);
  runner_.norm_forward(w_.norm_f, c.nf_out, c.nf_mean, c.nf_rstd, c.residual[L]);
  runner_.to_gemm_input(c.nf_lp, c.nf_out);
  ops_->column_forward(c.logits, c.nf_lp, w_.head);
  h.after_forward(L);
  ops_->cross_entropy(c.losses, c.logits, c.targets, cfg_.vocab_size, grad_scale);
  double sum = 0;
  const float* losses = c.losses.data<float>();
  for (int64_t i = 0; i < c.losses.numel(); ++i) sum += losses[i];
  return c.valid_targets > 0 ? sum / static_cast<double>(c.valid_targets) : 0.0;
}

void Transformer::backward_chunk(ActivationContext& c, const Chunk& ch) { backward_walk(c, ch, false); }

void Transformer::backward_chunk_input(ActivationContext& c, const Chunk& ch) {
  if (!ops_->splits_backward())
    throw UnsupportedError("a split (zero-bubble) backward needs the whole model's layer ops, not a tensor-parallel shard's");
  if (c.split.size() != static_cast<size_t>(cfg_.n_layers))
    throw Error("internal: a split backward needs a context made with split_backward");
  backward_walk(c, ch, true);
}

void Transformer::backward_walk(ActivationContext& c, const Chunk& ch, bool split) {
  check_chunk(ch);
  const auto s = attention_shape(c.B, c.T);
  const int64_t L = cfg_.n_layers;
  const char* pass = split ? "BI" : "B";
  LayerHooks none;
  LayerHooks& h = hooks_ ? *hooks_ : none;
  // Split: the units' hooks open here and close in the weight pass, when their gradients are final
  // (the embeddings' and the norms' are computed here).
  if (ch.head) {
    profile::ScopedSpanContext where(static_cast<int>(L), pass);
    h.before_backward(L);
    // LM head: logits hold dlogits after the fused softmax-cross-entropy.
    if (split)
      ops_->linear_backward_input(c.d_norm, w_.head, c.logits, c.nf_lp);
    else
      ops_->column_backward(&c.d_norm, w_.head, c.logits, c.nf_lp);
    c.d_res.fill_zero();
    if (c.norm_grads.defined()) c.norm_grads.fill_zero();
    runner_.norm_backward(partial_grads(w_.norm_f, c, 0), c.d_res, c.d_norm, c.residual[L], c.nf_mean, c.nf_rstd);
    add_partial_grads({&w_.norm_f}, c);
    if (!split) h.after_backward(L);
  }
  for (int64_t l = ch.last - 1; l >= ch.first; --l) {
    profile::ScopedSpanContext where(static_cast<int>(l), pass);
    h.before_backward(l);
    recompute_block(l, c, s);
    block_backward(l, w_.blocks[l], c.blocks[l], c, c.residual[l], s, split ? &c.split[static_cast<size_t>(l)] : nullptr);
    if (!split) h.after_backward(l);
  }
  if (ch.embeddings) {
    profile::ScopedSpanContext where(-1, pass);
    h.before_backward(-1);
    if (c.dwpe_rows.defined()) c.dwpe_rows.fill_zero();
    ops_->embedding_backward(w_.dwte, llama_ ? nullptr : c.dwpe_rows.defined() ? &c.dwpe_rows : &w_.dwpe, c.d_res,
                             c.tokens);
    add_position_grads(c);
    h.after_backward(-1);
  }
}

void Transformer::backward_chunk_weight(ActivationContext& c, const Chunk& ch) {
  check_chunk(ch);
  const int64_t L = cfg_.n_layers;
  LayerHooks none;
  LayerHooks& h = hooks_ ? *hooks_ : none;
  if (ch.head) {
    profile::ScopedSpanContext where(static_cast<int>(L), "BW");
    ops_->linear_backward_weight(w_.head, c.logits, c.nf_lp);
    h.after_backward(L);
  }
  for (int64_t l = ch.last - 1; l >= ch.first; --l) {
    profile::ScopedSpanContext where(static_cast<int>(l), "BW");
    block_backward_weight(w_.blocks[l], c.blocks[l], c.split[static_cast<size_t>(l)]);
    h.after_backward(l);
  }
}

}  // namespace loom::model
