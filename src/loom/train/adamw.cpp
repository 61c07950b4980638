#include "loom/train/adamw.h"

#include <algorithm>
#include <cmath>

#include "loom/kernels/elementwise.h"

namespace loom::train {

AdamW::AdamW(model::ParameterStore& params, AdamWConfig cfg, Allocator& alloc, std::vector<spec::ArenaRange> pieces)
    : params_(params), cfg_(cfg), pieces_(std::move(pieces)), sharded_(!pieces_.empty()) {
  if (pieces_.empty()) pieces_.push_back({0, params.table().total_numel()});
  int64_t n = 0;
  for (const auto& r : pieces_) {
    local_.push_back(n);
    n += r.size();
  }
  // bf16-pure: the moments are bf16 too (4 bytes of state per parameter instead of 8).
  const DType dtype = params.bf16_only() ? DType::BF16 : DType::F32;
  m_ = Tensor::zeros({n}, dtype, alloc, MemCategory::Optimizer);
  v_ = Tensor::zeros({n}, dtype, alloc, MemCategory::Optimizer);
}

void AdamW::step_bf16(double lr, double grad_scale, profile::Tracer* tracer) {
  // Weights, m and v are read widened, updated in f32 and rounded back stochastically, keyed by (seed,
  // step, parameter, global element): the same bits on every layout. Padding has no global element
  // and rounds to nearest (it stays zero).
  params_.set_rounding_step(step_);
  const uint64_t key = params_.rounding_key();
  auto cost = kernels::adamw_bf16_cost(m_.numel());
  profile::Span span(tracer, "adamw_bf16_stochastic", profile::Category::Kernel, cost.flops, cost.bytes);
  bf16* p = params_.lowp().data<bf16>();
  const float* g = params_.grads().data<float>();
  const auto& table = params_.table();
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const auto [lo, hi] = pieces_[k];
    bf16* m = m_.data<bf16>() + local_[k];  // element a of the arena is m[a - lo]
    bf16* v = v_.data<bf16>() + local_[k];
    for (const auto& spec : table.params()) {
      const int64_t a = std::max(spec.offset, lo), b = std::min(spec.offset + spec.numel(), hi);
      if (a >= b) continue;
      const uint64_t stream = model::ParameterStore::rounding_stream(spec.name);
      const float decay = spec.weight_decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
      table.for_each_global_run(spec, a - spec.offset, b - spec.offset, [&](int64_t local, int64_t global, int64_t n) {
        const int64_t at = spec.offset + local;
        const kernels::StochasticRounding sr{key, stream, global};
        kernels::adamw_update_bf16(p + at, m + (at - lo), v + (at - lo), g + at, n, static_cast<float>(lr),
                                   static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                                   static_cast<float>(cfg_.eps), decay, step_, static_cast<float>(grad_scale),
                                   global < 0 ? nullptr : &sr);
      });
    }
  }
}

void AdamW::step(double lr, double grad_scale, profile::Tracer* tracer) {
  ++step_;
  if (params_.bf16_only()) return step_bf16(lr, grad_scale, tracer);
  // bf16-sr: the update writes the masters only; the bf16 copies follow in a stochastic-rounding pass
  // keyed by this step (ParameterStore::write_lowp), the same bits on every layout.
  const bool stochastic = params_.stochastic_rounding();
  const bool lowp = params_.precision() == model::Precision::BF16 && !stochastic;
  auto cost = kernels::adamw_cost(m_.numel());
  profile::Span span(tracer, "adamw", profile::Category::Kernel, cost.flops, cost.bytes);
  float* p = params_.master().data<float>();
  float* g = params_.grads().data<float>();
  bf16* lp = lowp ? params_.lowp().data<bf16>() : nullptr;
  // Each parameter's part inside each piece (decay is per parameter, so a piece cut mid-tensor is fine).
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const auto [lo, hi] = pieces_[k];
    float* m = m_.data<float>() + local_[k];  // element a of the arena is m[a - lo]
    float* v = v_.data<float>() + local_[k];
    for (const auto& spec : params_.table().params()) {
      const int64_t a = std::max(spec.offset, lo), b = std::min(spec.offset + spec.numel(), hi);
      if (a >= b) continue;
      kernels::adamw_update(p + a, m + (a - lo), v + (a - lo), lp ? lp + a : nullptr, g + a, b - a, static_cast<float>(lr),
                            static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2), static_cast<float>(cfg_.eps),
                            spec.weight_decay ? static_cast<float>(cfg_.weight_decay) : 0.0f, step_,
                            static_cast<float>(grad_scale));
    }
  }
  if (stochastic) {
    params_.set_rounding_step(step_);
    auto c = kernels::cast_cost(m_.numel());
    profile::Span sr(tracer, "cast_bf16_stochastic", profile::Category::Kernel, 0, c.bytes);
    params_.write_lowp(pieces_);
  }
}

double grad_sum_squares(const model::ParameterStore& params, const std::vector<spec::ArenaRange>& pieces) {
  double s = 0;
  for (const auto& r : pieces)
    if (r.size() > 0) s += kernels::sum_squares(params.grads().data<float>() + r.begin, r.size());
  return s;
}

double global_grad_norm(const model::ParameterStore& params) {
  return std::sqrt(kernels::sum_squares(params.grads().data<float>(), params.grads().numel()));
}

}  // namespace loom::train
