// A model the planner is given as a Hugging Face `config.json` (GPT-2, Llama, Mistral and Mixtral
// families): the fields that decide its shape, mapped onto the spec's TransformerConfig (and, for
// Mixtral, the planner's expert count and top-k), with the same validation and one-line errors as the
// zoo. What Loom's block does not describe is refused, naming the field (an explicit head_dim that is
// not hidden_size / num_attention_heads, attention biases on a Llama-style model, an unknown family).
#pragma once

#include <string>

#include "loom/plan/model_zoo.h"

namespace loom::plan {

// `origin` names the text in errors (the file's path).
PlanModel parse_hf_config(const std::string& json_text, const std::string& origin);
PlanModel load_hf_config(const std::string& path);

}  // namespace loom::plan
