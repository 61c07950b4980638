#include "loom/train/adamw.h"

#include <algorithm>
#include <cmath>

#include "loom/kernels/elementwise.h"

namespace loom::train {

AdamW::AdamW(model::ParameterStore& params, AdamWConfig cfg, Allocator& alloc, int64_t shard_begin, int64_t shard_end)
    : params_(params),
      cfg_(cfg),
      lo_(shard_begin),
      hi_(shard_end < 0 ? params.table().total_numel() : shard_end) {
  m_ = Tensor::zeros({hi_ - lo_}, DType::F32, alloc, MemCategory::Optimizer);
  v_ = Tensor::zeros({hi_ - lo_}, DType::F32, alloc, MemCategory::Optimizer);
}

void AdamW::step(double lr, double grad_scale, profile::Tracer* tracer) {
  ++step_;
  const bool lowp = params_.precision() == model::Precision::BF16;
  auto cost = kernels::adamw_cost(hi_ - lo_);
  profile::Span span(tracer, "adamw", profile::Category::Kernel, cost.flops, cost.bytes);
  float* p = params_.master().data<float>();
  float* g = params_.grads().data<float>();
  bf16* lp = lowp ? params_.lowp().data<bf16>() : nullptr;
  // Each parameter's part inside the shard (decay is per parameter, so a shard cut mid-tensor is fine).
  for (const auto& spec : params_.table().params()) {
    const int64_t a = std::max(spec.offset, lo_), b = std::min(spec.offset + spec.numel(), hi_);
    if (a >= b) continue;
    kernels::adamw_update(p + a, m_.data<float>() + (a - lo_), v_.data<float>() + (a - lo_), lp ? lp + a : nullptr, g + a,
                          b - a, static_cast<float>(lr), static_cast<float>(cfg_.beta1),
                          static_cast<float>(cfg_.beta2), static_cast<float>(cfg_.eps),
                          spec.weight_decay ? static_cast<float>(cfg_.weight_decay) : 0.0f, step_,
                          static_cast<float>(grad_scale));
  }
}

double grad_sum_squares(const model::ParameterStore& params, int64_t begin, int64_t end) {
  return end > begin ? kernels::sum_squares(params.grads().data<float>() + begin, end - begin) : 0.0;
}

double global_grad_norm(const model::ParameterStore& params) {
  return std::sqrt(kernels::sum_squares(params.grads().data<float>(), params.grads().numel()));
}

}  // namespace loom::train
