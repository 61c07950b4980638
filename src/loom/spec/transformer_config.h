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

  int64_t head_dim() const { return d_model / n_heads; }
  bool uses_bias() const { return arch == Arch::GPT2; }
  // Throws ConfigError naming the first inconsistent field and what would be valid.
  void validate() const;
};

// The largest model Loom accepts: arena offsets and byte counts of every per-parameter buffer (f32
// masters, gradients, two moments) stay far inside 64 bits, and no real run comes near (2^42 = 4.4 T).
inline constexpr int64_t kMaxParameters = int64_t{1} << 42;

// The model's parameter count (the parameter table's tensors, without alignment padding), computed
// with checked arithmetic from the config alone, so it is safe on any input and linear in nothing.
CheckedSize checked_parameter_count(const TransformerConfig& cfg);

// Presets: tiny (tests), tiny-llama, mini (the default job), gpt2-124m, llama-mini.
TransformerConfig preset(std::string_view name);
std::vector<std::string> preset_names();

// Model FLOPs per token for MFU: 6 x (non-embedding parameters + LM head) + the causal attention
// term 6 * L * T * H * head_dim (QK^T and PV, forward + backward, half the square for causality).
double model_flops_per_token(const TransformerConfig& cfg, int64_t seq_len);

}  // namespace loom::spec
