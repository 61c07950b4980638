#include "loom/cli/layer_gemm_timing.h"

#include <algorithm>
#include <cmath>

#include "loom/spec/param_table.h"
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

AttentionOperands::AttentionOperands(const kernels::AttentionShape& s) : s_(s) {
  const auto rows = static_cast<size_t>(s.B * s.T), q = static_cast<size_t>(s.H * s.D),
             qkv = rows * static_cast<size_t>((s.H + 2 * s.KVH) * s.D);
  qkv_.resize(qkv), out_.resize(rows * q), lse_.resize(rows * static_cast<size_t>(s.H)), dout_.resize(rows * q);
  dqkv_.resize(qkv);
  for (size_t i = 0; i < qkv_.size(); ++i)
    qkv_[i] = 0.02f * static_cast<float>(static_cast<int>(i * 2654435761u % 97) - 48);
  for (size_t i = 0; i < dout_.size(); ++i) dout_[i] = 0.01f * static_cast<float>(static_cast<int>(i * 40503u % 89) - 44);
}

double AttentionOperands::run_once(ColdCaches& cold, Allocator& alloc) {
  return cold.time([&] { kernels::attention_forward(out_.data(), lse_.data(), qkv_.data(), s_, alloc); }) +
         cold.time([&] {
           kernels::attention_backward(dqkv_.data(), dout_.data(), out_.data(), lse_.data(), qkv_.data(), s_, alloc);
         });
}

size_t AttentionOperands::bytes(const kernels::AttentionShape& s) {
  // qkv and dqkv, out and dout, lse: as the constructor sizes them.
  return sizeof(float) * static_cast<size_t>(s.B * s.T * (2 * (s.H + 2 * s.KVH) * s.D + 2 * s.H * s.D + s.H));
}

double AttentionOperands::flops(const kernels::AttentionShape& s) {
  return kernels::attention_cost(s, false).flops + kernels::attention_cost(s, true).flops;
}

namespace {
// The rows of one micro-batch a layout of this config runs: the batch, a half and a quarter of it (dp =
// 2 and 4, or pipeline micro-batches) and the configured micro-batch.
std::vector<int64_t> layout_rows(const train::RunConfig& cfg) {
  const int64_t T = cfg.seq_len();
  std::vector<int64_t> rows = {cfg.train.batch_size * T};
  for (int64_t d : {2, 4})
    if (cfg.train.batch_size % d == 0) rows.push_back(cfg.train.batch_size / d * T);
  if (cfg.train.micro_batch_size > 0) rows.push_back(cfg.train.micro_batch_size * T);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

// The median of `t`, reordering it.
double median_of(std::vector<double>& t) {
  std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
  return t[t.size() / 2];
}

// Round-robin until `seconds` have passed (at least 5 counted rounds, at most 1000; round 0 creates
// primitives and workspaces and is not counted): run(i) times shape i once.
template <class Run>
void time_round_robin(size_t shapes, double seconds, Run&& run) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (int round = 0; (round <= 5 || elapsed() < seconds) && round <= 1000; ++round)
    for (size_t i = 0; i < shapes; ++i) run(i, round > 0);
}
}  // namespace

std::vector<LayerAttention> model_layer_attention(const std::string& config) {
  const train::RunConfig cfg = train::load_run_config(config);
  const spec::TransformerConfig& m = cfg.model.resolved;
  const int64_t T = cfg.seq_len(), D = m.head_dim();
  std::vector<LayerAttention> shapes;
  for (int tp : {1, 2}) {
    if (m.n_heads % tp || !spec::tp_splits_kv_heads(m, tp)) continue;
    // More ranks than KV heads: each rank holds one replicated KV head (as the engine and the time model).
    const int64_t kvh = spec::kv_heads_per_rank(m, tp);
    for (int64_t n : layout_rows(cfg))
      shapes.push_back({.shape = {.B = n / T, .T = T, .H = m.n_heads / tp, .KVH = kvh, .D = D,
                                  .scale = 1.0f / std::sqrt(float(D)), .bf16 = cfg.precision != model::Precision::FP32}});
  }
  return shapes;
}

std::vector<plan::MeasuredAttention> time_layer_attention(std::vector<LayerAttention>& shapes, double budget,
                                                          Allocator& alloc) {
  // Operands stay allocated between rounds up to 1 GiB in all (as the GEMMs'); past that a shape's are
  // rebuilt each round, untimed.
  constexpr size_t kKeepBytes = size_t{1} << 30;
  ColdCaches cold;
  std::vector<std::unique_ptr<AttentionOperands>> ops(shapes.size());
  std::vector<bool> keep(shapes.size());
  size_t kept = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const size_t bytes = AttentionOperands::bytes(shapes[i].shape);
    if (kept + bytes <= kKeepBytes) keep[i] = true, kept += bytes;
  }
  time_round_robin(shapes.size(), budget * static_cast<double>(shapes.size()), [&](size_t i, bool counted) {
    if (!ops[i]) ops[i] = std::make_unique<AttentionOperands>(shapes[i].shape);
    const double t = ops[i]->run_once(cold, alloc);
    if (counted) shapes[i].times.push_back(t);
    if (!keep[i]) ops[i].reset();
  });
  std::vector<plan::MeasuredAttention> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& s = shapes[i].shape;
    const double flops = AttentionOperands::flops(s);
    out.push_back({double(s.B), double(s.T), double(s.H), double(s.KVH), double(s.D), s.bf16 ? 2.0 : 4.0,
                   flops / median_of(shapes[i].times)});
  }
  return out;
}

std::vector<LayerGemm> model_layer_gemms(const std::string& config) {
  const train::RunConfig cfg = train::load_run_config(config);
  const spec::TransformerConfig& m = cfg.model.resolved;
  const DType dtype = cfg.precision == model::Precision::FP32 ? DType::F32 : DType::BF16;
  const std::vector<int64_t> rows = layout_rows(cfg);
  const int64_t C = m.d_model, hd = m.head_dim(), q = m.n_heads * hd, F = m.d_ff;
  const bool gpt2 = m.arch == spec::Arch::GPT2;
  const bool moe = m.moe.enabled(), dense = m.moe_layer_count() < m.n_layers;
  const int64_t Fe = m.expert_width(), Fs = m.moe.shared_experts * Fe, E = m.moe.experts, k = m.moe.top_k;
  std::vector<LayerGemm> shapes;
  auto add = [&](int64_t M, int64_t N, int64_t K, bool bias = false, bool residual = false) {
    LayerGemm g;
    g.M = M, g.N = N, g.K = K, g.dtype = dtype, g.bias = bias, g.residual = residual;
    shapes.push_back(std::move(g));
  };
  for (int tp : {1, 2}) {
    if (m.n_heads % tp || !spec::tp_splits_kv_heads(m, tp) || F % tp || m.vocab_size % tp || (moe && Fe % tp))
      continue;
    const int64_t kv_t = spec::kv_heads_per_rank(m, tp) * hd;  // one replicated KV head where tp exceeds them
    // One rank adds the residual stream in the out and down projections' epilogue; under tp the partial
    // sums are reduced first and added apart.
    const bool residual = tp == 1;
    for (int64_t n : rows) {
      add(n, q / tp + 2 * kv_t, C, gpt2);
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
  time_round_robin(shapes.size(), budget * static_cast<double>(shapes.size()), [&](size_t i, bool counted) {
    const double t = shapes[i].run_once(cold, keep[i], alloc);
    if (counted) shapes[i].times.push_back(t);
  });
  std::vector<plan::MeasuredGemm> out;
  for (auto& g : shapes) {
    const double flops = 3 * 2.0 * double(g.M) * double(g.N) * double(g.K);
    out.push_back({double(g.M), double(g.N), double(g.K), double(dtype_size(g.dtype)), flops / median_of(g.times)});
    g.fwd.reset(), g.dx.reset(), g.dw.reset();
  }
  return out;
}

}  // namespace loom::cli
