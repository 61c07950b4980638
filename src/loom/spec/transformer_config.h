// TransformerConfig: the shape of a decoder-only LM (GPT-2 or Llama family) and its named presets.
// Pure description: the model, the trainer and the planner all read it; nothing here executes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/spec/checked_size.h"

namespace loom::spec {

// GPT-2: LayerNorm, GELU(tanh) MLP, learned positions, biases, tied embeddings.
// Llama: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases.
enum class Arch { GPT2, Llama };

// How a mixture-of-experts router scores the experts: softmax over all of them (Mixtral, Switch) or an
// independent sigmoid per expert (DeepSeek-V3).
enum class RouterScore { Softmax, Sigmoid };
std::string_view router_score_name(RouterScore r);
RouterScore parse_router_score(std::string_view s);

// Mixture of experts ([model.moe]): the MLP of every `every`-th block (from block `first_dense` on) is
// replaced by `experts` SwiGLU experts of width `d_expert`, each token going to `top_k` of them, plus
// `shared_experts` experts every token passes through (DeepSeek). experts = 0: a dense model.
struct MoeConfig {
  int64_t experts = 0;
  int64_t top_k = 2;
  int64_t d_expert = 0;        // each expert's SwiGLU width (0: model.d_ff)
  int64_t shared_experts = 0;  // one SwiGLU MLP of width shared_experts x d_expert, no router weight
  int64_t every = 1;           // block l is MoE when l >= first_dense and (l - first_dense + 1) % every == 0
  int64_t first_dense = 0;     // the first blocks keep a dense MLP (DeepSeek's first_k_dense_replace)
  RouterScore score = RouterScore::Softmax;
  bool normalize_top_k = true;  // the top-k weights are rescaled to sum to 1
  // Tokens each expert takes per micro-batch: ceil(capacity_factor x tokens x top_k / experts); those
  // past it are dropped (in token order; their residual passes through). 0: dropless.
  double capacity_factor = 0.0;
  // Switch-style load-balancing loss, experts x sum_e f_e P_e, added to the loss with this weight.
  double aux_loss_coef = 0.0;
  // Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores only to choose
  // experts, moves by this much after every step toward the mean load. 0: off.
  double bias_update_rate = 0.0;

  bool enabled() const { return experts > 0; }
  // The most (token, slot) rows an expert takes from one rank's micro-batch of `tokens` tokens: its
  // capacity, or all tokens x top_k when dropless.
  int64_t capacity(int64_t tokens) const;
  // The most rows one rank's experts can be sent in a micro-batch under expert parallelism over `ep`
  // ranks (each with `tokens` tokens): every rank's rows for its experts -- ep x tokens x top_k when
  // dropless (all of them could choose this rank's experts), but never more than each of the experts'
  // capacity from each rank, experts x capacity, with a capacity factor.
  int64_t expert_side_rows(int64_t tokens, int ep) const;
};
std::string_view arch_name(Arch a);
// The token embedding's tensor name in the parameter table (Hugging Face's): the LM head's weight too
// when tied.
const char* token_embedding_name(Arch a);
Arch parse_arch(std::string_view s);

struct TransformerConfig {
  std::string name = "custom";
  Arch arch = Arch::GPT2;
  int64_t vocab_size = 8192;
  int64_t max_seq = 256;     // context length T the model is built for
  int64_t d_model = 384;     // C
  int64_t n_layers = 6;      // L
  int64_t n_heads = 6;       // H
  int64_t n_kv_heads = 6;    // KV heads (GQA when < n_heads); GPT-2 always equals n_heads
  int64_t d_ff = 1536;       // MLP hidden width (SwiGLU: width of gate and of up)
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  bool tie_embeddings = true;  // LM head reuses the token embedding
  float init_std = 0.02f;
  MoeConfig moe;

  int64_t head_dim() const { return d_model / n_heads; }
  bool uses_bias() const { return arch == Arch::GPT2; }
  // Whether block l's MLP is a mixture of experts, and the experts' SwiGLU width.
  bool is_moe_layer(int64_t l) const {
    return moe.enabled() && l >= moe.first_dense && (l - moe.first_dense + 1) % moe.every == 0;
  }
  int64_t expert_width() const { return moe.d_expert > 0 ? moe.d_expert : d_ff; }
  int64_t moe_layer_count() const;
  // Throws ConfigError naming the first inconsistent field and what would be valid.
  void validate() const;
};

// The largest model Loom accepts: arena offsets and byte counts of every per-parameter buffer (f32
// masters, gradients, two moments) stay far inside 64 bits, and no real run comes near (2^42 = 4.4 T).
inline constexpr int64_t kMaxParameters = int64_t{1} << 42;

// The model's parameter count (the parameter table's tensors, without alignment padding), computed
// with checked arithmetic from the config alone, so it is safe on any input and linear in nothing.
CheckedSize checked_parameter_count(const TransformerConfig& cfg);

// Presets: tiny (tests), tiny-llama, tiny-moe, mini (the default job), gpt2-124m, llama-mini, moe-mini.
TransformerConfig preset(std::string_view name);
std::vector<std::string> preset_names();

// Model FLOPs per token for MFU: 6 x (non-embedding parameters a token passes through + LM head) + the
// causal attention term 6 * L * T * H * head_dim (QK^T and PV, forward + backward, half the square for
// causality). A mixture of experts counts the router, top_k experts and the shared ones.
double model_flops_per_token(const TransformerConfig& cfg, int64_t seq_len);

}  // namespace loom::spec
