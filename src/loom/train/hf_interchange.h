// Hugging Face interchange: Loom's parameters as the tensors of HF's GPT2LMHeadModel /
// LlamaForCausalLM state dicts. Loom already uses HF names; the only layout difference is GPT-2's
// Conv1D, which stores its projections [in, out] where Loom (like nn.Linear) stores [out, in].
#pragma once

#include <string>

#include "loom/core/dtype.h"
#include "loom/model/parameter_store.h"
#include "loom/spec/transformer_config.h"

namespace loom::train {

// Writes every parameter under its HF name and layout (dtype F32 or BF16), with the Loom config as
// metadata ("loom_config"). Throws IoError.
void export_hf(const std::string& path, const model::ParameterStore& params, const spec::TransformerConfig& cfg,
               DType dtype, const std::string& config_toml);

// Reads an HF-layout file into `params`: every parameter must be present with the right shape
// (a tied model's absent lm_head is fine); unknown tensors are refused by name. Throws IoError.
void import_hf(const std::string& path, model::ParameterStore& params, const spec::TransformerConfig& cfg);

// The "loom_config" metadata of an exported file ("" if absent).
std::string hf_file_config(const std::string& path);

}  // namespace loom::train
