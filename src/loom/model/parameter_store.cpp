#include "loom/model/parameter_store.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

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

namespace {
// An arena of n elements: allocated and zeroed, or reserved (zero pages, backed when written).
Tensor make_arena(int64_t n, DType dtype, Allocator& alloc, MemCategory category, bool on_demand,
                  std::unique_ptr<PageReservation>& pages) {
  if (!on_demand) return Tensor::zeros({n}, dtype, alloc, category);
  pages = std::make_unique<PageReservation>(static_cast<size_t>(n) * dtype_size(dtype));
  return Tensor::wrap(pages->data(), {n}, dtype);
}
}  // namespace

ParameterStore::ParameterStore(spec::ParamTable table, Precision precision, Allocator& alloc, ArenaBacking backing,
                               WeightStorage storage)
    : table_(std::move(table)), precision_(precision), storage_(storage) {
  if (bf16_only() && precision_ != Precision::BF16)
    throw Error("internal: bf16-only weights need bf16 GEMMs (precision BF16)");
  const int64_t n = table_.total_numel();
  if (!bf16_only())
    master_ = make_arena(n, DType::F32, alloc, MemCategory::Parameters, backing.master_on_demand, master_pages_);
  if (backing.grads_memory) {
    grads_ = Tensor::wrap(backing.grads_memory, {n}, DType::F32);
    grads_.fill_zero();
  } else {
    grads_ = make_arena(n, DType::F32, alloc, MemCategory::Gradients, backing.grads_on_demand, grad_pages_);
  }
  if (precision_ == Precision::BF16)
    lowp_ = make_arena(n, DType::BF16, alloc, MemCategory::Parameters, backing.lowp_on_demand, lowp_pages_);
}

void ParameterStore::read_f32(int64_t begin, int64_t n, float* out) const {
  if (n <= 0) return;
  if (bf16_only())
    kernels::cast_bf16_to_f32(out, lowp_.data<bf16>() + begin, n);
  else
    std::memcpy(out, master_.data<float>() + begin, static_cast<size_t>(n) * sizeof(float));
}

void ParameterStore::write_f32(int64_t begin, int64_t n, const float* in) {
  if (n <= 0) return;
  if (bf16_only())
    kernels::cast_f32_to_bf16(lowp_.data<bf16>() + begin, in, n);
  else
    std::memcpy(master_.data<float>() + begin, in, static_cast<size_t>(n) * sizeof(float));
}

Tensor ParameterStore::view_of(const Tensor& arena, const spec::ParamSpec& p) const {
  return arena.view(p.offset, Shape(p.shape));
}

Tensor ParameterStore::param(const std::string& name) const { return view_of(weights(), table_.at(name)); }
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

Tensor ParameterStore::param_rows(const std::string& f, const std::string& l) const { return rows_of(weights(), f, l); }
Tensor ParameterStore::grad_rows(const std::string& f, const std::string& l) const { return rows_of(grads_, f, l); }
Tensor ParameterStore::compute_rows(const std::string& f, const std::string& l) const {
  return rows_of(precision_ == Precision::BF16 ? lowp_ : master_, f, l);
}

void ParameterStore::initialize(uint64_t seed, std::span<const spec::ArenaRange> only) {
  const spec::ArenaRange whole{0, table_.total_numel()};
  const auto ranges = only.empty() ? std::span<const spec::ArenaRange>(&whole, 1) : only;
  // Bf16Only: the same f32 draws, rounded to nearest once (every layout rounds the same value).
  auto fill = [&]<class T>(T* data) {
    auto store = [](T& out, float v) {
      if constexpr (std::is_same_v<T, bf16>)
        out = f32_to_bf16(v);
      else
        out = v;
    };
    for (const auto& p : table_.params()) {
      const uint64_t stream = stream_of(p.name);
      for (const auto& r : ranges) {
        // Element i of this parameter, for the indices inside the range.
        const int64_t lo = std::max<int64_t>(r.begin - p.offset, 0), hi = std::min(r.end - p.offset, p.numel());
        T* out = data + p.offset;
        switch (p.init.kind) {
          case spec::Init::Kind::Zeros:
            for (int64_t i = lo; i < hi; ++i) store(out[i], 0.0f);
            break;
          case spec::Init::Kind::Ones:
            for (int64_t i = lo; i < hi; ++i) store(out[i], 1.0f);
            break;
          case spec::Init::Kind::Normal: {
            // Keyed by the element of the whole tensor, so every layout draws the same number for it;
            // padding (a vocabulary tp does not divide) stays zero.
            const float std = p.init.std;
            const bool whole_tensor = table_.shard().whole() || !p.placement.on(spec::MeshAxis::TP).is_shard();
#pragma omp parallel for schedule(static)
            for (int64_t i = lo; i < hi; ++i) {
              const int64_t g = whole_tensor ? i : table_.global_element(p, i);
              store(out[i], g < 0 ? 0.0f : std * Philox::normal(seed, stream, static_cast<uint64_t>(g)));
            }
            break;
          }
        }
      }
    }
  };
  if (bf16_only())
    fill(lowp_.data<bf16>());
  else
    fill(master_.data<float>());
  if (only.empty()) zero_grads();  // on-demand gradients read as zero already
  refresh_lowp(only);
}

void ParameterStore::refresh_lowp(std::span<const spec::ArenaRange> only) {
  if (precision_ != Precision::BF16 || bf16_only()) return;  // bf16-only: the weights are the copies
  if (sr_ && rounding_step_ > 0) {
    const spec::ArenaRange all{0, master_.numel()};
    write_lowp(only.empty() ? std::span<const spec::ArenaRange>(&all, 1) : only);
    return;
  }
  if (only.empty()) {
    kernels::cast_f32_to_bf16(lowp_.data<bf16>(), master_.data<float>(), master_.numel());
    return;
  }
  for (const auto& r : only)
    kernels::cast_f32_to_bf16(lowp_.data<bf16>() + r.begin, master_.data<float>() + r.begin, r.size());
}

void ParameterStore::write_lowp(std::span<const spec::ArenaRange> ranges) {
  if (precision_ != Precision::BF16 || bf16_only()) return;
  bf16* lp = lowp_.data<bf16>();
  const float* m = master_.data<float>();
  if (!sr_ || rounding_step_ <= 0) {
    for (const auto& r : ranges)
      if (r.size() > 0) kernels::cast_f32_to_bf16(lp + r.begin, m + r.begin, r.size());
    return;
  }
  const uint64_t key = rounding_key();
  for (const auto& p : table_.params())
    for (const auto& r : ranges) {
      const int64_t a = std::max(p.offset, r.begin), b = std::min(p.offset + p.numel(), r.end);
      if (a >= b) continue;
      const uint64_t stream = rounding_stream(p.name);
      table_.for_each_global_run(p, a - p.offset, b - p.offset, [&](int64_t local, int64_t global, int64_t n) {
        if (global < 0)  // padding: no global element to key
          kernels::cast_f32_to_bf16(lp + p.offset + local, m + p.offset + local, n);
        else
          kernels::cast_f32_to_bf16_stochastic(lp + p.offset + local, m + p.offset + local, n, {key, stream, global});
      });
    }
}

// The key mixes the seed with the update step; the stream names the parameter (apart from
// initialisation's stream of the same name).
uint64_t ParameterStore::rounding_key() const {
  return sr_seed_ ^ (static_cast<uint64_t>(rounding_step_) * 0x9E3779B97F4A7C15ull);
}

uint64_t ParameterStore::rounding_stream(const std::string& name) {
  return stream_of(name) ^ 0x5354'4f43'4841'5354ull;  // "STOCHAST"
}

void ParameterStore::zero_grads() { grads_.fill_zero(); }

}  // namespace loom::model
