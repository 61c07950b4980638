#include "loom/plan/model_zoo.h"

#include <functional>
#include <map>

#include "loom/error.h"

namespace loom::plan {

namespace {

spec::TransformerConfig llama(const std::string& name, int64_t vocab, int64_t seq, int64_t d, int64_t layers,
                              int64_t heads, int64_t kv, int64_t ff, float theta) {
  spec::TransformerConfig c;
  c.name = name, c.arch = spec::Arch::Llama, c.tie_embeddings = false;
  c.vocab_size = vocab, c.max_seq = seq, c.d_model = d, c.n_layers = layers, c.n_heads = heads, c.n_kv_heads = kv;
  c.d_ff = ff, c.rope_theta = theta;
  return c;
}

PlanModel dense_llama(const std::string& name, int64_t vocab, int64_t seq, int64_t d, int64_t layers, int64_t heads,
                      int64_t kv, int64_t ff, float theta, const std::string& source) {
  return PlanModel{llama(name, vocab, seq, d, layers, heads, kv, ff, theta), source};
}

// A GPT-3-style model with its own vocabulary (Megatron's shapes use 51,200).
PlanModel gpt(const std::string& name, int64_t layers, int64_t hidden, int64_t heads, int64_t vocab, const std::string& source) {
  PlanModel m = megatron_gpt(name, layers, hidden, heads, 2048);
  m.cfg.vocab_size = vocab;
  m.source = source;
  return m;
}

// MPT's planner shape: GPT-2's parameter layout (biases are < 0.1% of its parameters) with a position
// table of one row per token of the job's sequence (PlanModel::positions_follow_sequence; 8K rows as
// listed): llm-foundry sizes it to max_seq_len, and ALiBi sets no limit.
PlanModel mpt(const std::string& name, int64_t layers, int64_t d, int64_t heads) {
  PlanModel m = megatron_gpt(name, layers, d, heads, 8192);
  m.positions_follow_sequence = true;
  m.cfg.vocab_size = 50368;
  m.source = "MosaicML llm-foundry scripts/train/yamls/pretrain/" + name + ".yaml";
  return m;
}

// Large models, by name. Shapes from the papers / model cards named in `source`.
const std::map<std::string, std::function<PlanModel()>>& zoo() {
  static const std::map<std::string, std::function<PlanModel()>> z = {
      {"gpt3-175b", [] { return gpt("gpt3-175b", 96, 12288, 96, 50257, "Brown et al. 2020, Table 2.1"); }},
      // Megatron-LM SC21 Table 1 and Korthikanti et al. Table 3 sizes (vocab 51,200, seq 2048).
      {"megatron-1.7b", [] { return megatron_gpt("megatron-1.7b", 24, 2304, 24, 2048); }},
      {"megatron-3.6b", [] { return megatron_gpt("megatron-3.6b", 30, 3072, 32, 2048); }},
      {"megatron-7.5b", [] { return megatron_gpt("megatron-7.5b", 36, 4096, 32, 2048); }},
      {"megatron-18b", [] { return megatron_gpt("megatron-18b", 40, 6144, 48, 2048); }},
      {"megatron-22b", [] { return megatron_gpt("megatron-22b", 48, 6144, 64, 2048); }},
      {"megatron-39b", [] { return megatron_gpt("megatron-39b", 48, 8192, 64, 2048); }},
      {"megatron-76b", [] { return megatron_gpt("megatron-76b", 60, 10240, 80, 2048); }},
      {"megatron-145b", [] { return megatron_gpt("megatron-145b", 80, 12288, 96, 2048); }},
      {"megatron-175b", [] { return megatron_gpt("megatron-175b", 96, 12288, 96, 2048); }},
      {"megatron-310b", [] { return megatron_gpt("megatron-310b", 96, 16384, 128, 2048); }},
      {"megatron-530b", [] { return megatron_gpt("megatron-530b", 105, 20480, 128, 2048); }},
      {"megatron-1t", [] { return megatron_gpt("megatron-1t", 128, 25600, 160, 2048); }},
      {"llama3-8b", [] { return dense_llama("llama3-8b", 128256, 8192, 4096, 32, 32, 8, 14336, 500000,
                                             "Llama 3 model card / Dubey et al. 2024 Table 3"); }},
      {"llama3-70b", [] { return dense_llama("llama3-70b", 128256, 8192, 8192, 80, 64, 8, 28672, 500000,
                                             "Llama 3 model card / Dubey et al. 2024 Table 3"); }},
      {"llama3-405b", [] { return dense_llama("llama3-405b", 128256, 8192, 16384, 126, 128, 8, 53248, 500000,
                                             "Dubey et al. 2024 Table 3"); }},
      // Llama 2 (Touvron et al. 2023, Table 1 and the released config.json files); llama2-34b is the
      // unreleased 34B's shape as Code Llama 34B and IBM's fms-fsdp train it (GQA, 8 KV heads).
      {"llama2-7b", [] { return dense_llama("llama2-7b", 32000, 4096, 4096, 32, 32, 32, 11008, 10000,
                                             "Touvron et al. 2023 (Llama 2) Table 1; meta-llama/Llama-2-7b config.json"); }},
      {"llama2-13b", [] { return dense_llama("llama2-13b", 32000, 4096, 5120, 40, 40, 40, 13824, 10000,
                                             "Touvron et al. 2023 (Llama 2) Table 1; meta-llama/Llama-2-13b config.json"); }},
      {"llama2-34b", [] { return dense_llama("llama2-34b", 32000, 4096, 8192, 48, 64, 8, 22016, 10000,
                                             "Code Llama 34B shape (Roziere et al. 2023); as in IBM fms-fsdp's llama2_34b"); }},
      {"llama2-70b", [] { return dense_llama("llama2-70b", 32000, 4096, 8192, 80, 64, 8, 28672, 10000,
                                             "Touvron et al. 2023 (Llama 2) Table 1; meta-llama/Llama-2-70b config.json"); }},
      // MosaicML MPT (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): GPT-style blocks with ALiBi (no
      // context limit: see mpt()), no biases, FFN 4x, tied embeddings, vocab 50,368.
      {"mpt-760m", [] { return mpt("mpt-760m", 24, 1536, 12); }},
      {"mpt-1b", [] { return mpt("mpt-1b", 24, 2048, 16); }},
      {"mpt-3b", [] { return mpt("mpt-3b", 32, 2560, 20); }},
      {"mpt-7b", [] { return mpt("mpt-7b", 32, 4096, 32); }},
      {"mpt-13b", [] { return mpt("mpt-13b", 40, 5120, 40); }},
      {"mpt-30b", [] { return mpt("mpt-30b", 48, 7168, 56); }},
      {"mpt-70b", [] { return mpt("mpt-70b", 80, 8192, 64); }},
      // NVIDIA NeMo's GPT-3 sizes (NeMo-Megatron-Launcher conf/training/gpt3/{5b,20b}.yaml), GPT-2 BPE.
      {"nemo-gpt3-5b", [] { return gpt("nemo-gpt3-5b", 24, 4096, 32, 50257, "NeMo-Megatron-Launcher conf/training/gpt3/5b.yaml"); }},
      {"nemo-gpt3-20b", [] { return gpt("nemo-gpt3-20b", 44, 6144, 48, 50257, "NeMo-Megatron-Launcher conf/training/gpt3/20b.yaml"); }},
      {"mixtral-8x7b",
       [] {
         spec::TransformerConfig c = llama("mixtral-8x7b", 32000, 4096, 4096, 32, 32, 8, 14336, 1e6);
         c.moe.experts = 8, c.moe.top_k = 2;
         return PlanModel{c, "Jiang et al. 2024 (Mixtral of Experts), Table 1"};
       }},
  };
  return z;
}

}  // namespace

PlanModel megatron_gpt(const std::string& name, int64_t layers, int64_t hidden, int64_t heads, int64_t seq) {
  PlanModel m;
  m.cfg.name = name, m.cfg.arch = spec::Arch::GPT2, m.cfg.tie_embeddings = true;
  m.cfg.vocab_size = 51200, m.cfg.max_seq = seq, m.cfg.d_model = hidden, m.cfg.n_layers = layers;
  m.cfg.n_heads = heads, m.cfg.n_kv_heads = heads, m.cfg.d_ff = 4 * hidden;
  m.source = "Megatron-LM (Narayanan et al. SC21 Table 1; Korthikanti et al. 2022 Table 3)";
  return m;
}

std::vector<std::string> plan_model_names() {
  std::vector<std::string> names = spec::preset_names();
  for (auto& [n, f] : zoo()) names.push_back(n);
  return names;
}

PlanModel plan_model(const std::string& name) {
  if (auto it = zoo().find(name); it != zoo().end()) {
    PlanModel m = it->second();
    m.cfg.validate();
    return m;
  }
  for (auto& p : spec::preset_names())
    if (p == name) return PlanModel{spec::preset(name), "Loom preset (spec/transformer_config.cpp)"};
  std::string valid;
  for (auto& n : plan_model_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw ConfigError("unknown model '" + name + "' (valid: " + valid +
                    "; or a model file: FILE.toml with a [model] table, or a Hugging Face config.json)");
}

ParamCounts count_params(const PlanModel& m) {
  const auto& c = m.cfg;
  const int64_t C = c.d_model, hd = c.head_dim(), F = c.d_ff;
  const bool gpt2 = c.arch == spec::Arch::GPT2;
  ParamCounts p;
  p.embedding = c.vocab_size * C + (gpt2 ? c.max_seq * C : 0);
  const int64_t q = c.n_heads * hd, kv = c.n_kv_heads * hd;
  int64_t attn = C * (q + 2 * kv) + q * C + (gpt2 ? (q + 2 * kv) + C : 0);
  int64_t norms = gpt2 ? 4 * C : 2 * C;
  // A dense block's MLP: GPT-2 c_fc + c_proj with biases; Llama gate, up, down. A mixture-of-experts
  // block's: the router, its SwiGLU experts (no biases) and the shared experts' SwiGLU MLP.
  const int64_t mlp = gpt2 ? 2 * C * F + F + C : 3 * C * F;
  const int64_t expert = 3 * C * c.expert_width(), E = m.n_experts();
  const int64_t bias = c.moe.bias_update_rate > 0 ? E : 0;  // auxiliary-loss-free selection bias
  const int64_t moe_mlp = C * E + bias + expert * E + expert * c.moe.shared_experts;
  const int64_t moe_layers = c.moe_layer_count(), dense_layers = c.n_layers - moe_layers;
  const int64_t blocks = c.n_layers * (attn + norms) + dense_layers * mlp + moe_layers * moe_mlp;
  p.per_layer_expert = moe_layers * expert * E / c.n_layers;
  p.per_layer = blocks / c.n_layers;
  p.final_norm = gpt2 ? 2 * C : C;
  p.lm_head = c.tie_embeddings ? 0 : c.vocab_size * C;
  p.total = p.embedding + blocks + p.final_norm + p.lm_head;
  p.active = p.total - moe_layers * expert * (E - m.top_k());
  return p;
}

// spec::model_flops_per_token's count, from the closed-form parameter counts instead of a built
// parameter table: the planner prices every layout it searches with it (tests pin the two equal).
double flops_per_token(const PlanModel& m, int64_t seq) {
  const auto& c = m.cfg;
  const ParamCounts p = count_params(m);
  // A token passes through top_k of the experts: the others' weights do no work for it.
  const double idle_experts = static_cast<double>(c.moe_layer_count()) * static_cast<double>(c.moe.experts - c.moe.top_k) *
                              3.0 * static_cast<double>(c.expert_width() * c.d_model);
  // The blocks and final norm, and the head's matmul (tied or not).
  const double dense = static_cast<double>(p.total - p.embedding - p.lm_head + c.vocab_size * c.d_model) - idle_experts;
  const double attention = 6.0 * static_cast<double>(c.n_layers * seq * c.n_heads * c.head_dim());
  return 6.0 * dense + attention;
}

}  // namespace loom::plan
