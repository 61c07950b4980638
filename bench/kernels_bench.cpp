// Every Loom kernel a training step runs, at the shapes `mini` runs them (and attention at T = 1024 and
// 2048), against this machine's roofline: Google Benchmark times each one and the counters give its
// GFLOP/s and GB/s (by the FLOPs and bytes the kernel declares, the same figures its trace spans carry)
// and `roof%`: the time the roofline allows (FLOPs at the measured GEMM peak of the kernel's dtype, or
// bytes at the STREAM triad's bandwidth, whichever is longer) over the time it took. The label says which
// roof bounds it. The kernel with the lowest roof% at the largest time is the next one to work on.
//   build/bench/kernels_bench [--benchmark_filter=attention] [--benchmark_min_time=0.2]
// The peak comes from kernels::device_peak_flops (cached per CPU and thread count, as MFU uses it; set
// LOOM_PEAK_FLOPS to skip it); the bandwidth is measured at start-up over 256 MiB arrays.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/kernels/attention.h"
#include "loom/kernels/elementwise.h"
#include "loom/kernels/gemm.h"
#include "loom/kernels/peak_probe.h"
#include "loom/kernels/stream_probe.h"

namespace {

using namespace loom;

struct Roof {
  double peak_f32 = 0, peak_bf16 = 0, bandwidth = 0;
};

const Roof& roof() {
  static const Roof r = [] {
    const int threads = omp_get_max_threads();
    Roof x;
    x.peak_f32 = kernels::device_peak_flops(DType::F32, threads).flops_per_s;
    x.peak_bf16 = kernels::device_peak_flops(DType::BF16, threads).flops_per_s;
    x.bandwidth = kernels::stream_triad_bandwidth(size_t{256} << 20, 3);
    std::fprintf(stderr, "roofline: peak f32 %.1f / bf16 %.1f GFLOP/s, memory %.1f GB/s (STREAM triad), %d threads\n",
                 x.peak_f32 / 1e9, x.peak_bf16 / 1e9, x.bandwidth / 1e9, threads);
    return x;
  }();
  return r;
}

// Times `run` (wall time: the kernels run on every OpenMP thread) and sets the counters from the kernel's
// declared cost per call: GFLOP and GB per second, and roof%.
void measure(benchmark::State& state, const kernels::KernelCost& cost, DType dtype, const std::function<void()>& run,
             const std::string& label_prefix = "") {
  run();  // first touch, primitive creation
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  const double per_call =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(state.iterations());
  const double peak = dtype == DType::BF16 ? roof().peak_bf16 : roof().peak_f32;
  const double t_compute = cost.flops / peak, t_memory = cost.bytes / roof().bandwidth;
  const double n = static_cast<double>(state.iterations());
  state.counters["GFLOP"] = benchmark::Counter(cost.flops * n / 1e9, benchmark::Counter::kIsRate);
  state.counters["GB"] = benchmark::Counter(cost.bytes * n / 1e9, benchmark::Counter::kIsRate);
  state.counters["roof%"] = 100 * std::max(t_compute, t_memory) / per_call;
  state.SetLabel(label_prefix + (t_compute >= t_memory ? "compute-bound" : "memory-bound"));
}

std::vector<float> filled(int64_t n, float scale = 0.01f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>(static_cast<int>(i * 2654435761u % 97) - 48);
  return v;
}

// `mini`: 8 sequences of 256 tokens, d_model 384, 6 heads of 64, d_ff 1536, vocabulary 8192.
constexpr int64_t kRows = 8 * 256, kModel = 384, kFf = 1536, kVocab = 8192;

// A linear layer's three GEMMs as the backend calls them (kernels::linear_gemms): the forward
// x[N, K] . W[M, K]^T, dX = dY . W and dW += dY^T . x, at the step's three widths (QKV, MLP in, head).
// The weight-gradient GEMM reads dY transposed and accumulates: the slowest of the three in a step.
enum class Pass { Forward, BackwardData, BackwardWeight };
void BM_gemm(benchmark::State& state, DType dtype, Pass pass) {
  const int64_t N = kRows, K = kModel, M = state.range(0);
  const kernels::LinearGemms all = kernels::linear_gemms(N, M, K, dtype);
  const kernels::GemmDesc d = pass == Pass::Forward        ? all.forward
                              : pass == Pass::BackwardData ? all.backward_data
                                                           : all.backward_weight;
  const size_t es = dtype == DType::BF16 ? 2 : 4;
  std::vector<std::byte> a(static_cast<size_t>(d.M * d.K) * es), b(static_cast<size_t>(d.K * d.N) * es);
  const auto fa = filled(d.M * d.K), fb = filled(d.K * d.N);
  if (dtype == DType::BF16) {
    kernels::cast_f32_to_bf16(reinterpret_cast<bf16*>(a.data()), fa.data(), d.M * d.K);
    kernels::cast_f32_to_bf16(reinterpret_cast<bf16*>(b.data()), fb.data(), d.K * d.N);
  } else {
    std::memcpy(a.data(), fa.data(), a.size());
    std::memcpy(b.data(), fb.data(), b.size());
  }
  std::vector<float> c(static_cast<size_t>(d.M * d.N));
  Allocator alloc;
  measure(state, kernels::gemm_cost(d), dtype,
          [&] { kernels::gemm(d, a.data(), b.data(), c.data(), nullptr, alloc); });
}
#define LOOM_GEMM_BENCH(name, dtype, pass)                                                                    \
  BENCHMARK_CAPTURE(BM_gemm, name, dtype, pass)->Arg(3 * kModel)->Arg(kFf)->Arg(kVocab)->Unit(benchmark::kMillisecond)->UseRealTime()
LOOM_GEMM_BENCH(f32, DType::F32, Pass::Forward);
LOOM_GEMM_BENCH(bf16, DType::BF16, Pass::Forward);
LOOM_GEMM_BENCH(bf16_bwd_data, DType::BF16, Pass::BackwardData);
LOOM_GEMM_BENCH(bf16_bwd_weight, DType::BF16, Pass::BackwardWeight);
#undef LOOM_GEMM_BENCH

// Causal attention, forward and backward, at mini's shape (B 8, T 256) and at T 1024 / 2048 (one
// sequence): the f32 kernels and the bf16 ones (bf16 operands, f32 accumulation; the f32 kernels where
// the CPU has no bf16 dot products), each against its dtype's peak. The label names the path that ran.
// `_dot` forces the AVX512-BF16 dot products: beside the default bf16 rows on an AMX machine (where
// those take the tiles) it is the same-run baseline of the tile path; elsewhere the two rows are one path.
void BM_attention(benchmark::State& state, bool backward, bool bf16, std::optional<kernels::AttentionPath> forced) {
  const int64_t T = state.range(0), B = T == 256 ? 8 : 1, H = 6, D = 64;
  kernels::AttentionShape s{.B = B, .T = T, .H = H, .KVH = H, .D = D, .scale = 1.0f / std::sqrt(float(D)), .bf16 = bf16};
  if (forced && !kernels::attention_path_supported(*forced)) {
    state.SkipWithError((std::string("this CPU cannot run ") + kernels::attention_path_name(*forced)).c_str());
    return;
  }
  const int64_t rows = B * T;
  auto qkv = filled(rows * 3 * H * D, 0.02f), dout = filled(rows * H * D);
  std::vector<float> out(static_cast<size_t>(rows * H * D)), lse(static_cast<size_t>(rows * H)), dqkv(qkv.size());
  Allocator alloc;
  kernels::attention_forward(out.data(), lse.data(), qkv.data(), s, alloc, forced);
  const kernels::AttentionPath path = forced ? *forced : kernels::attention_path(bf16);
  const DType peak = path == kernels::AttentionPath::Bf16Avx512 || path == kernels::AttentionPath::Bf16Amx
                         ? DType::BF16
                         : DType::F32;
  const std::string label = std::string(kernels::attention_path_name(path)) + ", ";
  if (!backward)
    measure(state, kernels::attention_cost(s, false), peak,
            [&] { kernels::attention_forward(out.data(), lse.data(), qkv.data(), s, alloc, forced); }, label);
  else
    measure(state, kernels::attention_cost(s, true), peak, [&] {
      kernels::attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), s, alloc, forced);
    }, label);
}
BENCHMARK_CAPTURE(BM_attention, fwd_f32, false, false, std::nullopt)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_attention, bwd_f32, true, false, std::nullopt)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_attention, fwd_bf16, false, true, std::nullopt)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_attention, bwd_bf16, true, true, std::nullopt)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_attention, fwd_bf16_dot, false, true, kernels::AttentionPath::Bf16Avx512)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_attention, bwd_bf16_dot, true, true, kernels::AttentionPath::Bf16Avx512)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_layernorm(benchmark::State& state, bool backward) {
  auto x = filled(kRows * kModel), dy = filled(kRows * kModel), w = filled(kModel, 1.0f), b = filled(kModel);
  std::vector<float> y(x.size()), dx(x.size()), mean(kRows), rstd(kRows), dw(kModel), db(kModel);
  kernels::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), kRows, kModel, 1e-5f);
  if (!backward)
    measure(state, kernels::layernorm_cost(kRows, kModel, false), DType::F32, [&] {
      kernels::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), kRows, kModel, 1e-5f);
    });
  else
    measure(state, kernels::layernorm_cost(kRows, kModel, true), DType::F32, [&] {
      kernels::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                                  rstd.data(), kRows, kModel);
    });
}
BENCHMARK_CAPTURE(BM_layernorm, fwd, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_layernorm, bwd, true)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_gelu(benchmark::State& state, bool backward) {
  const int64_t n = kRows * kFf;
  auto x = filled(n), dy = filled(n);
  std::vector<float> y(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
  if (!backward)
    measure(state, kernels::gelu_cost(n, false), DType::F32, [&] { kernels::gelu_forward(y.data(), x.data(), n); });
  else
    measure(state, kernels::gelu_cost(n, true), DType::F32,
            [&] { kernels::gelu_backward(dx.data(), x.data(), dy.data(), n); });
}
BENCHMARK_CAPTURE(BM_gelu, fwd, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_gelu, bwd, true)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The MLP activation in bf16 mode at mini's shape (h [2048, 1536]), fused with the casts around it (what
// the backend runs) or as the passes it replaced (`separate`): forward, GELU then the cast of its output
// for the down projection; backward, GELU's gradient, then the cast of it for the up projection's GEMMs
// with its bias gradient (already one pass). Compare the times; each row's counters are by its own cost.
void BM_gelu_bf16(benchmark::State& state, bool backward, bool fused) {
  const int64_t n = kRows * kFf;
  auto x = filled(n), dy = filled(n);
  std::vector<float> f32(static_cast<size_t>(n)), db(kFf);
  std::vector<bf16> lowp(static_cast<size_t>(n));
  if (fused && !backward) {
    measure(state, kernels::gelu_bf16_cost(kRows, kFf, false, false), DType::F32,
            [&] { kernels::gelu_forward(lowp.data(), x.data(), n); });
  } else if (fused) {
    measure(state, kernels::gelu_bf16_cost(kRows, kFf, true, true), DType::F32,
            [&] { kernels::gelu_backward(lowp.data(), db.data(), x.data(), dy.data(), kRows, kFf); });
  } else {
    kernels::KernelCost c = kernels::gelu_cost(n, backward);
    const auto cast = backward ? kernels::cast_bias_grad_cost(kRows, kFf) : kernels::cast_cost(n);
    c.flops += cast.flops, c.bytes += cast.bytes;
    measure(state, c, DType::F32, [&] {
      if (backward) {
        kernels::gelu_backward(f32.data(), x.data(), dy.data(), n);
        kernels::cast_f32_to_bf16_bias_grad(lowp.data(), db.data(), f32.data(), kRows, kFf);
      } else {
        kernels::gelu_forward(f32.data(), x.data(), n);
        kernels::cast_f32_to_bf16(lowp.data(), f32.data(), n);
      }
    });
  }
}
BENCHMARK_CAPTURE(BM_gelu_bf16, fwd_fused, false, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_gelu_bf16, fwd_separate, false, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_gelu_bf16, bwd_fused, true, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_gelu_bf16, bwd_separate, true, false)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The same for llama-mini's SwiGLU (gate|up [2048, 2 x 1024]): no bias, so backward's cast is a plain one.
void BM_swiglu_bf16(benchmark::State& state, bool backward, bool fused) {
  const int64_t N = kRows, F = 1024;
  auto gu = filled(N * 2 * F), dy = filled(N * F);
  std::vector<float> f32(static_cast<size_t>(N * 2 * F));
  std::vector<bf16> lowp(static_cast<size_t>(N * 2 * F));
  if (fused) {
    measure(state, kernels::swiglu_bf16_cost(N, F, backward), DType::F32, [&] {
      if (backward)
        kernels::swiglu_backward(lowp.data(), gu.data(), dy.data(), N, F);
      else
        kernels::swiglu_forward(lowp.data(), gu.data(), N, F);
    });
  } else {
    kernels::KernelCost c = kernels::swiglu_cost(N, F, backward);
    const auto cast = kernels::cast_cost(backward ? 2 * N * F : N * F);
    c.flops += cast.flops, c.bytes += cast.bytes;
    measure(state, c, DType::F32, [&] {
      if (backward) {
        kernels::swiglu_backward(f32.data(), gu.data(), dy.data(), N, F);
        kernels::cast_f32_to_bf16(lowp.data(), f32.data(), 2 * N * F);
      } else {
        kernels::swiglu_forward(f32.data(), gu.data(), N, F);
        kernels::cast_f32_to_bf16(lowp.data(), f32.data(), N * F);
      }
    });
  }
}
BENCHMARK_CAPTURE(BM_swiglu_bf16, fwd_fused, false, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_swiglu_bf16, fwd_separate, false, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_swiglu_bf16, bwd_fused, true, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_swiglu_bf16, bwd_separate, true, false)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_softmax_cross_entropy(benchmark::State& state) {
  auto logits = filled(kRows * kVocab);
  std::vector<int32_t> targets(kRows);
  for (int64_t i = 0; i < kRows; ++i) targets[static_cast<size_t>(i)] = static_cast<int32_t>(i * 7919 % kVocab);
  std::vector<float> losses(kRows), work(logits.size());
  measure(state, kernels::softmax_cross_entropy_cost(kRows, kVocab), DType::F32, [&] {
    // The kernel turns the logits into their gradient: a fresh copy each call (its bytes are not counted,
    // so this row's roof% errs low).
    std::memcpy(work.data(), logits.data(), logits.size() * sizeof(float));
    kernels::softmax_cross_entropy(losses.data(), work.data(), targets.data(), kRows, kVocab, 1.0f / kRows);
  });
}
BENCHMARK(BM_softmax_cross_entropy)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_bias_backward(benchmark::State& state) {
  auto dy = filled(kRows * kFf);
  std::vector<float> db(kFf);
  measure(state, kernels::bias_backward_cost(kRows, kFf), DType::F32,
          [&] { kernels::bias_backward(db.data(), dy.data(), kRows, kFf); });
}
BENCHMARK(BM_bias_backward)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_cast_f32_to_bf16(benchmark::State& state) {
  const int64_t n = kRows * kFf;
  auto x = filled(n);
  std::vector<bf16> y(static_cast<size_t>(n));
  measure(state, kernels::cast_cost(n), DType::F32, [&] { kernels::cast_f32_to_bf16(y.data(), x.data(), n); });
}
BENCHMARK(BM_cast_f32_to_bf16)->Unit(benchmark::kMicrosecond)->UseRealTime();

// A linear layer's output gradient in bf16 mode (mini's MLP, dY [2048, 1536]): cast to bf16 for the
// GEMMs and its bias gradient summed, in one pass (`fused`, what the backend runs) or as the two passes
// it replaced (`separate`). Compare the times; each row's counters are by its own declared cost.
void BM_dy_cast_and_bias_grad(benchmark::State& state, bool fused) {
  auto dy = filled(kRows * kFf);
  std::vector<bf16> lowp(dy.size());
  std::vector<float> db(kFf);
  if (fused) {
    measure(state, kernels::cast_bias_grad_cost(kRows, kFf), DType::F32,
            [&] { kernels::cast_f32_to_bf16_bias_grad(lowp.data(), db.data(), dy.data(), kRows, kFf); });
  } else {
    kernels::KernelCost c = kernels::cast_cost(kRows * kFf);
    c.flops += kernels::bias_backward_cost(kRows, kFf).flops;
    c.bytes += kernels::bias_backward_cost(kRows, kFf).bytes;
    measure(state, c, DType::F32, [&] {
      kernels::cast_f32_to_bf16(lowp.data(), dy.data(), kRows * kFf);
      kernels::bias_backward(db.data(), dy.data(), kRows, kFf);
    });
  }
}
BENCHMARK_CAPTURE(BM_dy_cast_and_bias_grad, fused, true)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_dy_cast_and_bias_grad, separate, false)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The bf16 weight copies after an update, mini's 13.9 M parameters: rounded to nearest (what AdamW writes
// in its own pass under bf16) or stochastically (bf16-sr's extra pass, one Philox block per 8 elements).
void BM_weight_copy(benchmark::State& state, bool stochastic) {
  const int64_t n = 13'900'000;
  auto p = filled(n);
  std::vector<bf16> copy(static_cast<size_t>(n));
  measure(state, kernels::cast_cost(n), DType::F32, [&] {
    if (stochastic)
      kernels::cast_f32_to_bf16_stochastic(copy.data(), p.data(), n, {1234, 99, 0});
    else
      kernels::cast_f32_to_bf16(copy.data(), p.data(), n);
  });
}
BENCHMARK_CAPTURE(BM_weight_copy, nearest, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_weight_copy, stochastic, true)->Unit(benchmark::kMillisecond)->UseRealTime();

// AdamW over mini's 13.9 M parameters, writing the bf16 copy.
void BM_adamw(benchmark::State& state) {
  const int64_t n = 13'900'000;
  auto p = filled(n), g = filled(n);
  std::vector<float> m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  std::vector<bf16> copy(static_cast<size_t>(n));
  int64_t step = 0;
  measure(state, kernels::adamw_cost(n), DType::F32, [&] {
    kernels::adamw_update(p.data(), m.data(), v.data(), copy.data(), g.data(), n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f,
                          ++step, 1.0f);
  });
}
BENCHMARK(BM_adamw)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  roof();  // measured before the first kernel, not inside its timing
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
