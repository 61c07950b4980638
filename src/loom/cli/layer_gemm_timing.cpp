#include "loom/cli/layer_gemm_timing.h"

#include <algorithm>

#include "loom/train/run_config.h"

namespace loom::cli {

GemmOperands::GemmOperands(const kernels::GemmDesc& desc, Allocator& alloc)
    : d(desc),
      a(alloc, dtype_size(d.ab_type) * d.M * d.K, MemCategory::Workspace),
      b(alloc, dtype_size(d.ab_type) * d.K * d.N, MemCategory::Workspace),
      c(alloc, sizeof(float) * d.M * d.N, MemCategory::Workspace) {
  const size_t elt = dtype_size(d.ab_type);
  auto fill = [](Buffer& buf, size_t n, size_t elt_size, unsigned mod) {
    auto* p = static_cast<unsigned char*>(buf.data());
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(i % mod + 1);
    for (size_t i = elt_size - 1; i < n; i += elt_size) p[i] = 0x3c;
  };
  fill(a, elt * d.M * d.K, elt, 61);
  fill(b, elt * d.K * d.N, elt, 53);
  fill(c, sizeof(float) * d.M * d.N, sizeof(float), 47);  // an accumulating GEMM reads it
  if (d.bias) bias = Buffer(alloc, sizeof(float) * d.N, MemCategory::Workspace), fill(bias, sizeof(float) * d.N, 4, 43);
  if (d.residual)
    residual = Buffer(alloc, sizeof(float) * d.M * d.N, MemCategory::Workspace),
    fill(residual, sizeof(float) * d.M * d.N, 4, 41);
}

void GemmOperands::run(Allocator& alloc) {
  kernels::gemm(d, a.data(), b.data(), static_cast<float*>(c.data()), static_cast<const float*>(bias.data()), alloc,
                static_cast<const float*>(residual.data()));
}

size_t LayerGemm::bytes() const {
  const auto e = static_cast<size_t>(dtype_size(dtype));
  const auto m = static_cast<size_t>(M), n = static_cast<size_t>(N), k = static_cast<size_t>(K);
  return (2 * e + 4) * (m * k + m * n + k * n) + (residual ? 4 * m * n : 0);  // three (a, b, c) sets
}

double LayerGemm::run_once(ColdCaches& cold, bool keep, Allocator& alloc) {
  if (!fwd) {
    kernels::LinearGemms g = kernels::linear_gemms(M, N, K, dtype);
    g.forward.bias = bias, g.forward.residual = residual;
    fwd = std::make_unique<GemmOperands>(g.forward, alloc);
    dx = std::make_unique<GemmOperands>(g.backward_data, alloc);
    dw = std::make_unique<GemmOperands>(g.backward_weight, alloc);
  }
  const double t = cold.time([&] { fwd->run(alloc); }) + cold.time([&] { dx->run(alloc); }) +
                   cold.time([&] { dw->run(alloc); });
  if (!keep) fwd.reset(), dx.reset(), dw.reset();
  return t;
}

std::vector<LayerGemm> model_layer_gemms(const std::string& config) {
  const train::RunConfig cfg = train::load_run_config(config);
  const spec::TransformerConfig& m = cfg.model.resolved;
  const DType dtype = cfg.precision == model::Precision::FP32 ? DType::F32 : DType::BF16;
  const int64_t T = cfg.seq_len();
  std::vector<int64_t> rows = {cfg.train.batch_size * T};
  for (int64_t d : {2, 4})
    if (cfg.train.batch_size % d == 0) rows.push_back(cfg.train.batch_size / d * T);
  if (cfg.train.micro_batch_size > 0) rows.push_back(cfg.train.micro_batch_size * T);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  const int64_t C = m.d_model, hd = m.head_dim(), q = m.n_heads * hd, kv = m.n_kv_heads * hd, F = m.d_ff;
  const bool gpt2 = m.arch == spec::Arch::GPT2;
  const bool moe = m.moe.enabled(), dense = m.moe_layer_count() < m.n_layers;
  const int64_t Fe = m.expert_width(), Fs = m.moe.shared_experts * Fe, E = m.moe.experts, k = m.moe.top_k;
  std::vector<LayerGemm> shapes;
  auto add = [&](int64_t M, int64_t N, int64_t K, bool bias = false, bool residual = false) {
    LayerGemm g;
    g.M = M, g.N = N, g.K = K, g.dtype = dtype, g.bias = bias, g.residual = residual;
    shapes.push_back(std::move(g));
  };
  for (int64_t tp : {1, 2}) {
    if (m.n_heads % tp || m.n_kv_heads % tp || F % tp || m.vocab_size % tp || (moe && Fe % tp)) continue;
    // One rank adds the residual stream in the out and down projections' epilogue; under tp the partial
    // sums are reduced first and added apart.
    const bool residual = tp == 1;
    for (int64_t n : rows) {
      add(n, (q + 2 * kv) / tp, C, gpt2);
      add(n, C, q / tp, gpt2, residual);
      add(n, m.vocab_size / tp, C);
      if (dense) add(n, (gpt2 ? F : 2 * F) / tp, C, gpt2), add(n, C, F / tp, gpt2, residual);
      if (Fs > 0) add(n, 2 * Fs / tp, C), add(n, C, Fs / tp, false, residual);
      // Each SwiGLU expert's GEMMs at its mean rows, n k ep / E, for ep in {1, 2, 4} dividing the
      // experts (the planner prices the experts at those shapes).
      if (moe)
        for (int64_t ep : {1, 2, 4}) {
          if (E % ep || (n * k * ep) % E) continue;
          const int64_t r = n * k * ep / E;
          add(r, 2 * Fe / tp, C);
          add(r, C, Fe / tp);
        }
    }
  }
  return shapes;
}

// Round-robin, not each shape's repetitions in a row: this VM has slow phases seconds long, and a shape
// timed wholly inside one read 28% slow against its neighbours (llama-mini's half-batch GEMMs, so every
// dp = 2 layout was predicted 18-22% slow). Spread over the rounds, a slow phase moves every shape's
// median alike, or none. Operands stay allocated between rounds up to 1 GiB in all (the model's first
// shapes); past that a shape's operands are rebuilt each round, untimed.
std::vector<plan::MeasuredGemm> time_layer_gemms(std::vector<LayerGemm>& shapes, double budget, Allocator& alloc) {
  constexpr size_t kKeepBytes = size_t{1} << 30;
  std::vector<bool> keep(shapes.size());
  size_t kept = 0;
  for (size_t i = 0; i < shapes.size(); ++i)
    if (kept + shapes[i].bytes() <= kKeepBytes) keep[i] = true, kept += shapes[i].bytes();
  ColdCaches cold;
  const auto start = std::chrono::steady_clock::now();
  const double total = budget * static_cast<double>(shapes.size());
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (int round = 0; (round <= 5 || elapsed() < total) && round <= 1000; ++round)
    for (size_t i = 0; i < shapes.size(); ++i) {
      const double t = shapes[i].run_once(cold, keep[i], alloc);
      if (round > 0) shapes[i].times.push_back(t);
    }
  std::vector<plan::MeasuredGemm> out;
  for (auto& g : shapes) {
    auto& t = g.times;
    std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
    const double flops = 3 * 2.0 * double(g.M) * double(g.N) * double(g.K);
    out.push_back({double(g.M), double(g.N), double(g.K), double(dtype_size(g.dtype)), flops / t[t.size() / 2]});
    g.fwd.reset(), g.dx.reset(), g.dw.reset();
  }
  return out;
}

}  // namespace loom::cli
