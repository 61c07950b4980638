#include "loom/model/parameter_store.h"

#include "loom/core/philox.h"
#include "loom/error.h"
#include "loom/kernels/elementwise.h"

namespace loom::model {

Precision parse_precision(const std::string& s) {
  if (s == "fp32" || s == "f32") return Precision::FP32;
  if (s == "bf16") return Precision::BF16;
  throw ConfigError("precision = '" + s + "' is not supported (valid: \"fp32\", \"bf16\")");
}

const char* precision_name(Precision p) { return p == Precision::FP32 ? "fp32" : "bf16"; }

ParameterStore::ParameterStore(spec::ParamTable table, Precision precision, Allocator& alloc)
    : table_(std::move(table)), precision_(precision) {
  const int64_t n = table_.total_numel();
  master_ = Tensor::zeros({n}, DType::F32, alloc, MemCategory::Parameters);
  grads_ = Tensor::zeros({n}, DType::F32, alloc, MemCategory::Gradients);
  if (precision_ == Precision::BF16) lowp_ = Tensor::zeros({n}, DType::BF16, alloc, MemCategory::Parameters);
}

Tensor ParameterStore::view_of(const Tensor& arena, const spec::ParamSpec& p) const {
  return arena.view(p.offset, Shape(p.shape));
}

Tensor ParameterStore::param(const std::string& name) const { return view_of(master_, table_.at(name)); }
Tensor ParameterStore::grad(const std::string& name) const { return view_of(grads_, table_.at(name)); }
Tensor ParameterStore::compute(const std::string& name) const {
  return view_of(precision_ == Precision::BF16 ? lowp_ : master_, table_.at(name));
}

Tensor ParameterStore::rows_of(const Tensor& arena, const std::string& first, const std::string& last) const {
  size_t i = *table_.index_of(table_.at(first).name), j = *table_.index_of(table_.at(last).name);
  const auto& ps = table_.params();
  int64_t rows = 0, cols = ps[i].shape.back();
  for (size_t k = i; k <= j; ++k) {
    if (ps[k].shape.size() != 2 || ps[k].shape[1] != cols || (k > i && ps[k].offset != ps[k - 1].offset + ps[k - 1].numel()))
      throw ConfigError("parameters " + first + " .. " + last +
                        " are not adjacent matrices of equal width; the fused GEMM needs d_model to be a multiple of 16");
    rows += ps[k].shape[0];
  }
  return arena.view(ps[i].offset, {rows, cols});
}

Tensor ParameterStore::param_rows(const std::string& f, const std::string& l) const { return rows_of(master_, f, l); }
Tensor ParameterStore::grad_rows(const std::string& f, const std::string& l) const { return rows_of(grads_, f, l); }
Tensor ParameterStore::compute_rows(const std::string& f, const std::string& l) const {
  return rows_of(precision_ == Precision::BF16 ? lowp_ : master_, f, l);
}

void ParameterStore::initialize(uint64_t seed) {
  float* data = master_.data<float>();
  for (const auto& p : table_.params()) {
    float* out = data + p.offset;
    const int64_t n = p.numel();
    const uint64_t stream = stream_of(p.name);
    switch (p.init.kind) {
      case spec::Init::Kind::Zeros:
        for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
        break;
      case spec::Init::Kind::Ones:
        for (int64_t i = 0; i < n; ++i) out[i] = 1.0f;
        break;
      case spec::Init::Kind::Normal: {
        const float std = p.init.std;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) out[i] = std * Philox::normal(seed, stream, static_cast<uint64_t>(i));
        break;
      }
    }
  }
  zero_grads();
  refresh_lowp();
}

void ParameterStore::refresh_lowp() {
  if (precision_ == Precision::BF16)
    kernels::cast_f32_to_bf16(lowp_.data<bf16>(), master_.data<float>(), master_.numel());
}

void ParameterStore::zero_grads() { grads_.fill_zero(); }

}  // namespace loom::model
