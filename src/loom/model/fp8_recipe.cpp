#include "loom/model/fp8_recipe.h"

#include <algorithm>
#include <cmath>

#include "loom/error.h"

namespace loom::model {

namespace {
constexpr int kLinears = 4, kRoles = 3;
const char* const kLinearNames[kLinears] = {"qkv", "out", "up", "down"};
const char* const kRoleNames[kRoles] = {"input", "weight", "output_grad"};
}  // namespace

Fp8Scaling parse_fp8_scaling(const std::string& s) {
  if (s == "delayed") return Fp8Scaling::Delayed;
  if (s == "current") return Fp8Scaling::Current;
  if (s == "blockwise") return Fp8Scaling::Blockwise;
  throw ConfigError("fp8.recipe = '" + s + "' is not a recipe (valid: \"delayed\", \"current\", \"blockwise\")");
}

const char* fp8_scaling_name(Fp8Scaling s) {
  return s == Fp8Scaling::Delayed ? "delayed" : s == Fp8Scaling::Current ? "current" : "blockwise";
}

Fp8Recipe::Fp8Recipe(Fp8Config cfg, int64_t n_layers, Allocator& alloc)
    : cfg_(cfg), n_layers_(n_layers), alloc_(alloc),
      slot_stats_(static_cast<size_t>(n_layers * kLinears * kRoles)),
      history_(slot_stats_.size()) {
  if (cfg_.amax_history < 1) throw ConfigError("fp8.amax_history must be at least 1");
  if (cfg_.block < 1) throw ConfigError("the fp8 block size must be at least 1");
}

size_t Fp8Recipe::slot(int64_t layer, Fp8Linear k, Fp8Role r) const {
  if (layer < 0 || layer >= n_layers_) throw Error("internal: fp8 slot of layer " + std::to_string(layer));
  return static_cast<size_t>((layer * kLinears + static_cast<int>(k)) * kRoles + static_cast<int>(r));
}

std::string Fp8Recipe::slot_name(size_t s) {
  const size_t role = s % kRoles, linear = (s / kRoles) % kLinears, layer = s / (kRoles * kLinears);
  return "layers." + std::to_string(layer) + "." + kLinearNames[linear] + "." + kRoleNames[role];
}

float Fp8Recipe::tensor_scale(size_t s, Fp8Role r, const std::function<float()>& current_amax) const {
  const int margin = static_cast<int>(cfg_.margin);
  if (cfg_.recipe == Fp8Scaling::Delayed) {
    float most = 0;
    for (float a : history_[s]) most = std::max(most, a);
    if (most > 0) return kernels::fp8_scale(most, format(r), margin);
  }
  return kernels::fp8_scale(current_amax(), format(r), margin);  // current, or no history yet
}

void Fp8Recipe::record(size_t s, const kernels::Fp8Stats& st) { slot_stats_[s].merge(st); }

void Fp8Recipe::quantize_input(int64_t layer, Fp8Linear k, const Tensor& lp, const Tensor& x) {
  if (x.dtype() != DType::F32 || lp.dtype() != DType::BF16 || lp.numel() != x.numel())
    throw ShapeError("fp8: a GEMM input must be f32 quantised into a bf16 tensor of its size");
  const size_t s = slot(layer, k, Fp8Role::Input);
  const float* in = x.data<float>();
  bf16* out = lp.data<bf16>();
  if (cfg_.recipe == Fp8Scaling::Blockwise) {
    const int64_t cols = x.dim(-1);
    return record(s, kernels::fake_quantize_rows(out, in, x.numel() / cols, cols, cfg_.block, Fp8Format::E4M3));
  }
  const float scale = tensor_scale(s, Fp8Role::Input, [&] { return kernels::amax(in, x.numel()); });
  record(s, kernels::fake_quantize(out, in, x.numel(), Fp8Format::E4M3, scale));
}

BlockWeights Fp8Recipe::weights(int64_t layer, const BlockWeights& w) {
  if (layer == cached_layer_ && generation_ == cached_generation_) return cached_;
  LinearViews* linears[kLinears] = {&cached_.qkv, &cached_.out, &cached_.up, &cached_.down};
  cached_ = w;
  int64_t total = 0;
  for (const LinearViews* l : linears) total += l->w.numel();
  if (!weight_scratch_.defined() || weight_scratch_.numel() < total)
    weight_scratch_ = Tensor::empty({total}, DType::BF16, alloc_, MemCategory::Workspace);
  int64_t at = 0;
  for (int k = 0; k < kLinears; ++k) {
    LinearViews& l = *linears[k];
    if (l.w.dtype() != DType::BF16) throw Error("internal: fp8 quantises bf16 weights");
    const Tensor q = weight_scratch_.view(at, l.w.shape());
    at += l.w.numel();
    const size_t s = slot(layer, static_cast<Fp8Linear>(k), Fp8Role::Weight);
    const bf16* in = l.w.data<bf16>();
    if (cfg_.recipe == Fp8Scaling::Blockwise) {
      record(s, kernels::fake_quantize_tiles(q.data<bf16>(), in, l.w.dim(0), l.w.dim(1), cfg_.block, Fp8Format::E4M3));
    } else {
      const float scale = tensor_scale(s, Fp8Role::Weight, [&] { return kernels::amax(in, l.w.numel()); });
      record(s, kernels::fake_quantize(q.data<bf16>(), in, l.w.numel(), Fp8Format::E4M3, scale));
    }
    l.w = q;
  }
  cached_layer_ = layer, cached_generation_ = generation_;
  return cached_;
}

void Fp8Recipe::quantize_output_grad(int64_t layer, Fp8Linear k, const Tensor& out, const Tensor& dy) {
  if (dy.dtype() != DType::F32 || out.dtype() != DType::F32 || out.numel() < dy.numel())
    throw ShapeError("fp8: an output gradient is quantised f32 to f32");
  const size_t s = slot(layer, k, Fp8Role::OutputGrad);
  const float* in = dy.data<float>();
  if (cfg_.recipe == Fp8Scaling::Blockwise) {
    const int64_t cols = dy.dim(-1);
    return record(s, kernels::fake_quantize_rows(out.data<float>(), in, dy.numel() / cols, cols, cfg_.block,
                                                 cfg_.grad_format));
  }
  const float scale = tensor_scale(s, Fp8Role::OutputGrad, [&] { return kernels::amax(in, dy.numel()); });
  record(s, kernels::fake_quantize(out.data<float>(), in, dy.numel(), cfg_.grad_format, scale));
}

void Fp8Recipe::end_step(const Reduce& reduce) {
  const size_t n = slot_stats_.size();
  std::vector<float> amax(n);
  std::vector<double> counts(2 * n);
  for (size_t s = 0; s < n; ++s) {
    // A non-finite amax (a step the bad-step guard skips) would poison the history: it counts as 0.
    amax[s] = std::isfinite(slot_stats_[s].amax) ? slot_stats_[s].amax : 0.0f;
    counts[2 * s] = static_cast<double>(slot_stats_[s].overflow);
    counts[2 * s + 1] = static_cast<double>(slot_stats_[s].underflow);
  }
  if (reduce) reduce(amax, counts);
  last_counts_.clear();
  last_overflow_ = last_underflow_ = 0;
  for (size_t s = 0; s < n; ++s) {
    slot_stats_[s] = {};
    const auto over = static_cast<int64_t>(counts[2 * s]), under = static_cast<int64_t>(counts[2 * s + 1]);
    last_overflow_ += over, last_underflow_ += under;
    if (over || under) last_counts_.push_back({slot_name(s), over, under});
    // Only tensors quantised this step (on some rank) enter the history.
    if (amax[s] > 0) {
      auto& h = history_[s];
      h.push_back(amax[s]);
      if (static_cast<int64_t>(h.size()) > cfg_.amax_history) h.erase(h.begin());
    }
  }
  ++generation_;  // the update changed the weights
}

std::vector<std::pair<std::string, std::vector<float>>> Fp8Recipe::histories() const {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (size_t s = 0; s < history_.size(); ++s)
    if (!history_[s].empty()) out.push_back({slot_name(s), history_[s]});
  return out;
}

void Fp8Recipe::restore(const std::vector<std::pair<std::string, std::vector<float>>>& histories) {
  for (auto& h : history_) h.clear();
  for (const auto& [name, values] : histories) {
    size_t s = 0;
    while (s < history_.size() && slot_name(s) != name) ++s;
    if (s == history_.size())
      throw ConfigError("fp8 scaling state names tensor '" + name + "', which this model does not have");
    for (float v : values)
      if (!std::isfinite(v) || v < 0)
        throw ConfigError("fp8 scaling state of tensor '" + name + "' holds an amax of " + std::to_string(v) +
                          "; an amax is finite and not negative");
    // A shorter fp8.amax_history than the checkpoint's keeps the newest entries.
    const size_t keep = std::min(values.size(), static_cast<size_t>(cfg_.amax_history));
    history_[s].assign(values.end() - static_cast<std::ptrdiff_t>(keep), values.end());
  }
  ++generation_;
}

}  // namespace loom::model
