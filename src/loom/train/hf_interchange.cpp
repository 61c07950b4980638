#include "loom/train/hf_interchange.h"

#include <set>
#include <vector>

#include "loom/core/bf16.h"
#include "loom/core/safetensors.h"
#include "loom/error.h"

namespace loom::train {

namespace {

bool is_conv1d(const spec::TransformerConfig& cfg, const std::string& name) {
  if (cfg.arch != spec::Arch::GPT2) return false;
  for (const char* suffix : {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}) {
    const std::string s(suffix);
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

}  // namespace

void export_hf(const std::string& path, const model::ParameterStore& params, const spec::TransformerConfig& cfg,
               DType dtype, const std::string& config_toml) {
  if (dtype != DType::F32 && dtype != DType::BF16)
    throw ConfigError("export dtype must be f32 or bf16, not " + std::string(dtype_name(dtype)));
  std::vector<std::vector<unsigned char>> storage;
  std::vector<SafetensorsEntry> entries;
  for (const auto& p : params.table().params()) {
    std::vector<float> values(static_cast<size_t>(p.numel()));  // widened exactly from bf16-only weights
    params.read_f32(p.offset, p.numel(), values.data());
    const float* src = values.data();
    std::vector<int64_t> shape = p.shape;
    const bool transpose = is_conv1d(cfg, p.name);
    if (transpose) std::swap(shape[0], shape[1]);
    const int64_t n = p.numel();
    storage.emplace_back(static_cast<size_t>(n) * dtype_size(dtype));
    auto& buf = storage.back();
    for (int64_t i = 0; i < n; ++i) {
      // src is [R, C] = [out, in]; a transposed output [C, R] takes element i = c * R + r from r * C + c.
      const int64_t j = transpose ? (i % p.shape[0]) * p.shape[1] + i / p.shape[0] : i;
      if (dtype == DType::F32)
        reinterpret_cast<float*>(buf.data())[i] = src[j];
      else
        reinterpret_cast<bf16*>(buf.data())[i] = f32_to_bf16(src[j]);
    }
    entries.push_back({p.name, dtype, shape, buf.data(), buf.size()});
  }
  write_safetensors(path, entries, {{"format", "pt"}, {"loom_config", config_toml}});
}

void import_hf(const std::string& path, model::ParameterStore& params, const spec::TransformerConfig& cfg) {
  SafetensorsFile f(path);
  std::set<std::string> known;
  for (const auto& p : params.table().params()) {
    known.insert(p.name);
    std::vector<int64_t> shape = p.shape;
    const bool transpose = is_conv1d(cfg, p.name);
    if (transpose) std::swap(shape[0], shape[1]);
    if (!f.contains(p.name)) throw IoError(path + ": tensor '" + p.name + "' is missing; is this a model of this config?");
    const auto& e = f.at(p.name);
    if (e.shape != shape)
      throw IoError(path + ": tensor '" + p.name + "' has the wrong shape for this config (check the model keys)");
    if (e.dtype != DType::F32 && e.dtype != DType::BF16)
      throw IoError(path + ": tensor '" + p.name + "' is " + std::string(dtype_name(e.dtype)) + "; Loom imports F32 or BF16");
    const int64_t n = p.numel();
    std::vector<float> dst(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      // dst is [out, in] = [r][c]; the file holds [c][r] when transposed.
      int64_t j = transpose ? (i % p.shape[1]) * p.shape[0] + i / p.shape[1] : i;
      dst[static_cast<size_t>(i)] = e.dtype == DType::F32 ? static_cast<const float*>(e.data)[j]
                                                          : bf16_to_f32(static_cast<const bf16*>(e.data)[j]);
    }
    params.write_f32(p.offset, n, dst.data());
  }
  for (const auto& e : f.tensors()) {
    const bool tied_head = e.name == "lm_head.weight" && cfg.tie_embeddings;
    const bool hf_buffer = e.name.find(".attn.bias") != std::string::npos || e.name.find("masked_bias") != std::string::npos ||
                           e.name.find("rotary_emb.inv_freq") != std::string::npos;
    if (!known.count(e.name) && !tied_head && !hf_buffer)
      throw IoError(path + ": tensor '" + e.name + "' has no place in this model (architecture or config mismatch)");
  }
  params.refresh_lowp();
}

std::string hf_file_config(const std::string& path) {
  SafetensorsFile f(path);
  auto it = f.metadata().find("loom_config");
  return it == f.metadata().end() ? "" : it->second;
}

}  // namespace loom::train
