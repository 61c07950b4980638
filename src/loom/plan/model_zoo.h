// The models the planner knows: every Loom preset (from spec::preset) plus large published models
// (GPT-3 175B, the Megatron-LM sizes, Llama-3 8B/70B/405B, a Mixtral-style 8x7B MoE), wrapping the
// spec's TransformerConfig (its [model.moe] included); parameter counts are computed in closed form (and
// agree exactly with spec::build_param_table for the presets -- tests pin it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/spec/transformer_config.h"

namespace loom::plan {

struct PlanModel {
  spec::TransformerConfig cfg;
  std::string source;  // where the shape comes from
  // MPT (llm-foundry): ALiBi positions, with a learned table beside them sized to the run's
  // max_seq_len, so no context limit: the table holds one row per token of the planned sequence, as
  // llm-foundry's NumParams counts it (MPT 7B: 6,658,859,008 at 2K, 6,918,905,856 at 64K).
  bool positions_follow_sequence = false;

  // The model as a job of `seq` tokens holds it: max_seq = seq where positions_follow_sequence.
  PlanModel at_sequence(int64_t seq) const {
    PlanModel m = *this;
    if (positions_follow_sequence && seq > 0) m.cfg.max_seq = seq;
    return m;
  }

  bool is_moe() const { return cfg.moe.enabled(); }
  int64_t n_experts() const { return is_moe() ? cfg.moe.experts : 1; }  // experts per MoE block (1: dense)
  int64_t top_k() const { return is_moe() ? cfg.moe.top_k : 1; }        // experts each token is routed to
};

// Loom preset or zoo name (case-sensitive); throws ConfigError listing every valid name.
PlanModel plan_model(const std::string& name);
std::vector<std::string> plan_model_names();
// A GPT-2-style (Megatron) model of the given shape: vocab 51,200, learned positions, 4h MLP, tied.
PlanModel megatron_gpt(const std::string& name, int64_t layers, int64_t hidden, int64_t heads, int64_t seq);

// Parameter counts (exact, including biases and norm gains).
struct ParamCounts {
  int64_t embedding = 0;   // token (+ learned position) embeddings
  int64_t per_layer = 0;   // one transformer block, the mean over blocks (all experts for MoE)
  int64_t per_layer_expert = 0;  // of per_layer: expert MLP weights (all experts), the mean; 0 for dense
  int64_t final_norm = 0;
  int64_t lm_head = 0;     // 0 when tied to the embedding
  int64_t total = 0;
  int64_t active = 0;      // parameters a token touches (top_k experts of n)
};
ParamCounts count_params(const PlanModel& m);

// Training FLOPs per token in Loom's MFU convention (spec::model_flops_per_token; for
// MoE only the active experts count).
double flops_per_token(const PlanModel& m, int64_t seq);

}  // namespace loom::plan
