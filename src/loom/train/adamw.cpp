#include "loom/train/adamw.h"

#include <cmath>

#include "loom/kernels/elementwise.h"

namespace loom::train {

AdamW::AdamW(model::ParameterStore& params, AdamWConfig cfg, Allocator& alloc) : params_(params), cfg_(cfg) {
  const int64_t n = params.table().total_numel();
  m_ = Tensor::zeros({n}, DType::F32, alloc, MemCategory::Optimizer);
  v_ = Tensor::zeros({n}, DType::F32, alloc, MemCategory::Optimizer);
}

void AdamW::step(double lr, double grad_scale, profile::Tracer* tracer) {
  ++step_;
  const bool lowp = params_.precision() == model::Precision::BF16;
  auto cost = kernels::adamw_cost(params_.table().total_numel());
  profile::Span span(tracer, "adamw", profile::Category::Kernel, cost.flops, cost.bytes);
  float* p = params_.master().data<float>();
  float* g = params_.grads().data<float>();
  bf16* lp = lowp ? params_.lowp().data<bf16>() : nullptr;
  for (const auto& spec : params_.table().params()) {
    const int64_t o = spec.offset;
    kernels::adamw_update(p + o, m_.data<float>() + o, v_.data<float>() + o, lp ? lp + o : nullptr, g + o, spec.numel(),
                          static_cast<float>(lr), static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                          static_cast<float>(cfg_.eps), spec.weight_decay ? static_cast<float>(cfg_.weight_decay) : 0.0f,
                          step_, static_cast<float>(grad_scale));
  }
}

double global_grad_norm(const model::ParameterStore& params) {
  return std::sqrt(kernels::sum_squares(params.grads().data<float>(), params.grads().numel()));
}

}  // namespace loom::train
