#include "loom/kernels/cpu_backend.h"

#include <omp.h>

#include <vector>

#include "loom/core/cpu_features.h"
#include "loom/error.h"
#include "loom/kernels/amx_tiles.h"
#include "loom/kernels/elementwise.h"
#include "loom/kernels/gemm.h"

namespace loom::kernels {

using profile::Category;
using profile::Span;

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw ShapeError(what);
}

// Rows and columns of a tensor seen as a matrix whose columns are its last dimension.
int64_t rows(const Tensor& t) { return t.shape().rank() == 0 ? 1 : t.numel() / t.dim(-1); }
int64_t cols(const Tensor& t) { return t.shape().rank() == 0 ? 1 : t.dim(-1); }

std::string sh(const Tensor& t) { return std::string(dtype_name(t.dtype())) + t.shape().str(); }

void expect_f32(const Tensor& t, const char* op, const char* name) {
  expect(t.dtype() == DType::F32, std::string(op) + ": " + name + " must be F32, got " + sh(t));
}

// A norm gain, norm bias or linear bias as f32: the tensor itself, or (precision = "bf16-pure", whose
// weights are bf16 only) widened exactly into `widened`. They are vectors of one row's width, so the
// copy costs nothing beside the pass that reads them N times.
const float* f32_weights(const Tensor& w, std::vector<float>& widened) {
  if (w.dtype() == DType::F32) return w.data<float>();
  expect(w.dtype() == DType::BF16, "weights must be F32 or BF16, got " + sh(w));
  widened.resize(static_cast<size_t>(w.numel()));
  cast_bf16_to_f32(widened.data(), w.data<bf16>(), w.numel());
  return widened.data();
}

}  // namespace

CpuBackend::CpuBackend(Allocator& alloc, profile::Tracer* tracer, int threads)
    : alloc_(alloc), tracer_(tracer), threads_(threads > 0 ? threads : omp_get_num_procs()) {
  omp_set_num_threads(threads_);
}

std::string CpuBackend::describe() const {
  const auto& f = CpuFeatures::detect();
  std::string bf16 = gemm_bf16_mode() == Bf16GemmMode::Native
                         ? "native"
                         : "unavailable on this CPU: bf16 runs as bf16-rounded inputs with f32 GEMMs";
  // A CPU with AMX whose tile unit Loom cannot use says why (OS permission, self-test); under an ISA
  // cap below amx the unit is not probed at all.
  const std::string amx_note =
      f.kernel_isa() >= KernelIsa::Amx && !amx_tiles_status().ready ? "; AMX tiles unused: " + amx_tiles_status().detail
                                                                      : "";
  return "cpu " + f.summary() + ", " + std::to_string(threads_) + " threads, kernels " + f.vector_isa() +
         ", gemm f32 " + gemm_impl_name(DType::F32) + ", gemm bf16 " + gemm_impl_name(DType::BF16) + " (bf16 " +
         bf16 + "), attention " + attention_path_name(attention_path(false)) + " (bf16 runs: " +
         attention_path_name(attention_path(true)) + amx_note + "), activations and casts " +
         elementwise_path_name(elementwise_path());
}

void* CpuBackend::scratch(size_t bytes) {
  if (scratch_.size() < bytes) {
    scratch_ = Buffer();  // release first, so the peak does not count both
    scratch_ = Buffer(alloc_, bytes, MemCategory::Workspace);
  }
  return scratch_.data();
}

void CpuBackend::linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b, bool accumulate) {
  linear_forward_gemm(y, nullptr, x, w, b, accumulate);
}

void CpuBackend::linear_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x, const Tensor& w,
                                    const Tensor* b) {
  expect_f32(residual, "linear_forward_add", "residual");
  expect(residual.shape() == y.shape() && residual.raw() != y.raw(),
         "linear_forward_add: the residual " + sh(residual) + " must be shaped as y " + sh(y) + " and not be y");
  linear_forward_gemm(y, &residual, x, w, b, false);
}

void CpuBackend::linear_forward_gemm(const Tensor& y, const Tensor* residual, const Tensor& x, const Tensor& w,
                                     const Tensor* b, bool accumulate) {
  expect(x.dtype() == w.dtype(), "linear: input " + sh(x) + " and weight " + sh(w) + " must share a dtype");
  expect(w.shape().rank() == 2 && cols(x) == w.dim(1) && rows(y) == rows(x) && cols(y) == w.dim(0),
         "linear: y " + sh(y) + " != x " + sh(x) + " . w^T " + sh(w));
  expect_f32(y, "linear", "output");
  GemmDesc d = linear_gemms(rows(x), w.dim(0), w.dim(1), x.dtype()).forward;
  d.accumulate = accumulate, d.bias = b != nullptr, d.residual = residual != nullptr;
  auto c = gemm_cost(d);
  Span span(tracer_, "gemm_fwd", Category::Gemm, c.flops, c.bytes);
  std::vector<float> bias;
  gemm(d, x.raw(), w.raw(), y.data<float>(), b ? f32_weights(*b, bias) : nullptr, alloc_,
       residual ? residual->data<float>() : nullptr);
}

namespace {
// Checks a grouped linear's operands: one weight per group, offsets ascending within the rows.
void expect_groups(const Tensor& x, std::span<const Tensor> w, std::span<const int64_t> offsets, const char* op) {
  expect(!w.empty() && offsets.size() == w.size() + 1 && offsets.front() == 0 && offsets.back() <= rows(x),
         std::string(op) + ": " + std::to_string(w.size()) + " weights need " + std::to_string(w.size() + 1) +
             " ascending row offsets from 0 within x " + sh(x));
  for (size_t g = 0; g < w.size(); ++g)
    expect(offsets[g] <= offsets[g + 1] && w[g].shape() == w[0].shape() && w[g].dtype() == x.dtype() &&
               w[g].dim(1) == cols(x),
           std::string(op) + ": group " + std::to_string(g) + "'s weight " + sh(w[g]) + " or rows do not fit x " + sh(x));
}
// f(group, first row, rows) for every group that has rows.
template <class F>
void for_each_group(std::span<const int64_t> offsets, F&& f) {
  for (size_t g = 0; g + 1 < offsets.size(); ++g)
    if (offsets[g + 1] > offsets[g]) f(g, offsets[g], offsets[g + 1] - offsets[g]);
}
}  // namespace

void CpuBackend::grouped_linear_forward(const Tensor& y, const Tensor& x, std::span<const Tensor> w,
                                        std::span<const int64_t> offsets) {
  expect_groups(x, w, offsets, "grouped_linear");
  expect_f32(y, "grouped_linear", "output");
  const int64_t OC = w[0].dim(0), IC = w[0].dim(1), M = offsets.back();
  expect(rows(y) >= M && cols(y) == OC, "grouped_linear: y " + sh(y) + " does not fit " + std::to_string(M) + " rows x " +
                                            std::to_string(OC));
  auto c = gemm_cost(linear_gemms(M, OC, IC, x.dtype()).forward);
  Span span(tracer_, "gemm_grouped_fwd", Category::Gemm, c.flops, c.bytes);
  const size_t xe = dtype_size(x.dtype());
  for_each_group(offsets, [&](size_t g, int64_t r0, int64_t n) {
    GemmDesc d = linear_gemms(n, OC, IC, x.dtype()).forward;
    d.runtime_shape = true;
    gemm(d, static_cast<const std::byte*>(x.raw()) + r0 * IC * static_cast<int64_t>(xe), w[g].raw(),
         y.data<float>() + r0 * OC, nullptr, alloc_);
  });
}

void CpuBackend::grouped_linear_backward(const Tensor& dx, std::span<const Tensor> dw, const Tensor& dy,
                                         const Tensor& x, std::span<const Tensor> w, std::span<const int64_t> offsets) {
  expect_groups(x, w, offsets, "grouped_linear_backward");
  expect_f32(dx, "grouped_linear_backward", "dx");
  expect_f32(dy, "grouped_linear_backward", "dy");
  const int64_t OC = w[0].dim(0), IC = w[0].dim(1), M = offsets.back();
  expect(dw.size() == w.size() && rows(dy) >= M && cols(dy) == OC && rows(dx) >= M && cols(dx) == IC,
         "grouped_linear_backward: dy " + sh(dy) + ", dx " + sh(dx) + " or the gradients do not fit the weights " +
             sh(w[0]));
  // The output gradient in the weights' precision, cast once for every group.
  const Tensor g_all = M > 0 ? prepare_output_grad(dy.slice(0, M), nullptr, w[0]) : dy;
  const size_t ge = dtype_size(g_all.dtype()), xe = dtype_size(x.dtype());
  const LinearGemms all = linear_gemms(M, OC, IC, w[0].dtype());
  auto data_cost = gemm_cost(all.backward_data);
  {
    Span span(tracer_, "gemm_grouped_bwd_data", Category::Gemm, data_cost.flops, data_cost.bytes);
    for_each_group(offsets, [&](size_t g, int64_t r0, int64_t n) {
      GemmDesc d = linear_gemms(n, OC, IC, w[g].dtype()).backward_data;
      d.runtime_shape = true;
      gemm(d, static_cast<const std::byte*>(g_all.raw()) + r0 * OC * static_cast<int64_t>(ge), w[g].raw(),
           dx.data<float>() + r0 * IC, nullptr, alloc_);
    });
  }
  auto weight_cost = gemm_cost(all.backward_weight);
  Span span(tracer_, "gemm_grouped_bwd_weight", Category::Gemm, weight_cost.flops, weight_cost.bytes);
  for_each_group(offsets, [&](size_t g, int64_t r0, int64_t n) {
    expect(dw[g].shape() == w[g].shape() && dw[g].dtype() == DType::F32,
           "grouped_linear_backward: gradient " + sh(dw[g]) + " does not fit its weight " + sh(w[g]));
    GemmDesc d = linear_gemms(n, OC, IC, w[g].dtype()).backward_weight;
    d.runtime_shape = true;
    gemm(d, static_cast<const std::byte*>(g_all.raw()) + r0 * OC * static_cast<int64_t>(ge),
         static_cast<const std::byte*>(x.raw()) + r0 * IC * static_cast<int64_t>(xe), dw[g].data<float>(), nullptr,
         alloc_);
  });
}

Tensor CpuBackend::prepare_output_grad(const Tensor& dy, const Tensor* db, const Tensor& w) {
  if (dy.dtype() == DType::BF16 && w.dtype() == DType::BF16) {
    // Prepared already (activation_backward_output_grad): the bias gradient was taken there.
    expect(!db && cols(dy) == w.dim(0), "prepare_output_grad: a bf16 dy " + sh(dy) +
                                            " is prepared already; its bias gradient must have been taken with it");
    return dy;
  }
  expect_f32(dy, "prepare_output_grad", "dy");
  expect(cols(dy) == w.dim(0) && (!db || db->numel() == w.dim(0)),
         "prepare_output_grad: dy " + sh(dy) + " does not fit w " + sh(w));
  const int64_t N = rows(dy), OC = cols(dy);
  if (w.dtype() != DType::BF16) {
    if (db) {
      auto c = bias_backward_cost(N, OC);
      Span span(tracer_, "bias_bwd", Category::Kernel, c.flops, c.bytes);
      bias_backward(db->data<float>(), dy.data<float>(), N, OC);
    }
    return dy;
  }
  // The gradient enters both GEMMs in the same precision as the weights and activations; the bias
  // gradient is summed while dy is read for the cast.
  bf16* lowp = static_cast<bf16*>(scratch(sizeof(bf16) * dy.numel()));
  if (db) {
    auto c = cast_bias_grad_cost(N, OC);
    Span span(tracer_, "cast_dy_bf16", Category::Kernel, c.flops, c.bytes);
    cast_f32_to_bf16_bias_grad(lowp, db->data<float>(), dy.data<float>(), N, OC);
  } else {
    Span span(tracer_, "cast_dy_bf16", Category::Kernel, 0, cast_cost(dy.numel()).bytes);
    cast_f32_to_bf16(lowp, dy.data<float>(), dy.numel());
  }
  return Tensor::wrap(lowp, dy.shape(), DType::BF16);
}

void CpuBackend::linear_backward(const Tensor* dx, bool dx_accumulate, const Tensor& dw, const Tensor* db,
                                 const Tensor& dy, const Tensor& x, const Tensor& w) {
  expect(dy.dtype() == DType::F32 || (dy.dtype() == w.dtype() && !db),
         "linear_backward: dy " + sh(dy) + " must be f32, or in the weights' dtype from prepare_output_grad "
         "(with the bias gradient taken there)");
  expect(rows(dy) == rows(x) && cols(dy) == w.dim(0) && cols(x) == w.dim(1) && (!dw.defined() || dw.shape() == w.shape()),
         "linear_backward: dy " + sh(dy) + ", x " + sh(x) + ", w " + sh(w) + ", dw " + sh(dw) + " do not fit");
  const int64_t N = rows(x), IC = w.dim(1);
  // The bias gradient is taken where dy is prepared (with the cast, for bf16 weights).
  const bool prepared = w.dtype() == DType::BF16 && dy.dtype() == DType::BF16;
  const Tensor g_tensor = prepared ? dy : prepare_output_grad(dy, db, w);
  const int64_t OC = w.dim(0);
  const void* g = g_tensor.raw();
  if (dx) {
    expect_f32(*dx, "linear_backward", "dx");
    expect(dx->numel() == N * IC, "linear_backward: dx " + sh(*dx) + " does not match x " + sh(x));
    GemmDesc d = linear_gemms(N, OC, IC, w.dtype()).backward_data;
    d.accumulate = dx_accumulate;
    auto c = gemm_cost(d);
    Span span(tracer_, "gemm_bwd_data", Category::Gemm, c.flops, c.bytes);
    gemm(d, g, w.raw(), dx->data<float>(), nullptr, alloc_);
  }
  if (dw.defined()) {
    const GemmDesc d = linear_gemms(N, OC, IC, w.dtype()).backward_weight;
    auto c = gemm_cost(d);
    Span span(tracer_, "gemm_bwd_weight", Category::Gemm, c.flops, c.bytes);
    gemm(d, g, x.raw(), dw.data<float>(), nullptr, alloc_);
  }
}

void CpuBackend::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) {
  expect(tokens.dtype() == DType::I32 && tokens.shape().rank() == 2, "embedding: tokens must be I32 [B, T], got " +
                                                                         sh(tokens));
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = wte.dim(1);
  expect(out.numel() == B * T * C, "embedding: out " + sh(out) + " must hold B*T*C values");
  expect(!wpe || wpe->dim(0) >= T, "embedding: sequence length exceeds the position table");
  auto c = embedding_cost(B * T, C);
  Span span(tracer_, "embedding_fwd", Category::Kernel, c.flops, c.bytes);
  if (wpe) expect(wpe->dtype() == wte.dtype(), "embedding: wte " + sh(wte) + " and wpe " + sh(*wpe) + " must share a dtype");
  if (wte.dtype() == DType::BF16)
    kernels::embedding_forward(out.data<float>(), tokens.data<int32_t>(), wte.data<bf16>(),
                               wpe ? wpe->data<bf16>() : nullptr, B, T, C);
  else
    kernels::embedding_forward(out.data<float>(), tokens.data<int32_t>(), wte.data<float>(),
                               wpe ? wpe->data<float>() : nullptr, B, T, C);
}

void CpuBackend::embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) {
  const int64_t B = tokens.dim(0), T = tokens.dim(1), C = dwte.dim(1);
  auto c = embedding_cost(B * T, C);
  Span span(tracer_, "embedding_bwd", Category::Kernel, c.flops, c.bytes);
  kernels::embedding_backward(dwte.data<float>(), dwpe ? dwpe->data<float>() : nullptr, dout.data<float>(),
                              tokens.data<int32_t>(), B, T, C);
}

void CpuBackend::layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                   const Tensor& w, const Tensor& b, float eps) {
  const int64_t N = rows(x), C = cols(x);
  expect(out.numel() == N * C && mean.numel() == N && rstd.numel() == N && w.numel() == C && b.numel() == C,
         "layernorm: shapes do not fit x " + sh(x));
  auto c = layernorm_cost(N, C, false);
  Span span(tracer_, "layernorm_fwd", Category::Kernel, c.flops, c.bytes);
  std::vector<float> w32, b32;
  kernels::layernorm_forward(out.data<float>(), mean.data<float>(), rstd.data<float>(), x.data<float>(),
                             f32_weights(w, w32), f32_weights(b, b32), N, C, eps);
}

void CpuBackend::layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                                    const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  const int64_t N = rows(x), C = cols(x);
  auto c = layernorm_cost(N, C, true);
  Span span(tracer_, "layernorm_bwd", Category::Kernel, c.flops, c.bytes);
  std::vector<float> w32;
  kernels::layernorm_backward(dx.data<float>(), dw.data<float>(), db.data<float>(), dout.data<float>(),
                              x.data<float>(), f32_weights(w, w32), mean.data<float>(), rstd.data<float>(), N, C);
}

void CpuBackend::rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  const int64_t N = rows(x), C = cols(x);
  expect(out.numel() == N * C && rstd.numel() == N && w.numel() == C, "rmsnorm: shapes do not fit x " + sh(x));
  auto c = rmsnorm_cost(N, C, false);
  Span span(tracer_, "rmsnorm_fwd", Category::Kernel, c.flops, c.bytes);
  std::vector<float> w32;
  kernels::rmsnorm_forward(out.data<float>(), rstd.data<float>(), x.data<float>(), f32_weights(w, w32), N, C, eps);
}

void CpuBackend::rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                                  const Tensor& w, const Tensor& rstd) {
  const int64_t N = rows(x), C = cols(x);
  auto c = rmsnorm_cost(N, C, true);
  Span span(tracer_, "rmsnorm_bwd", Category::Kernel, c.flops, c.bytes);
  std::vector<float> w32;
  kernels::rmsnorm_backward(dx.data<float>(), dw.data<float>(), dout.data<float>(), x.data<float>(),
                            f32_weights(w, w32), rstd.data<float>(), N, C);
}

void CpuBackend::gelu_forward(const Tensor& out, const Tensor& x) {
  expect_f32(x, "gelu_forward", "x");
  expect(out.numel() == x.numel(), "gelu_forward: out " + sh(out) + " does not match x " + sh(x));
  if (out.dtype() == DType::BF16) {  // fused with the cast for the next GEMM
    auto c = gelu_bf16_cost(rows(x), cols(x), false, false);
    Span span(tracer_, "gelu_fwd_bf16", Category::Kernel, c.flops, c.bytes);
    kernels::gelu_forward(static_cast<bf16*>(out.raw()), x.data<float>(), x.numel());
    return;
  }
  auto c = gelu_cost(x.numel(), false);
  Span span(tracer_, "gelu_fwd", Category::Kernel, c.flops, c.bytes);
  kernels::gelu_forward(out.data<float>(), x.data<float>(), x.numel());
}

void CpuBackend::gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout) {
  auto c = gelu_cost(x.numel(), true);
  Span span(tracer_, "gelu_bwd", Category::Kernel, c.flops, c.bytes);
  kernels::gelu_backward(dx.data<float>(), x.data<float>(), dout.data<float>(), x.numel());
}

void CpuBackend::swiglu_forward(const Tensor& out, const Tensor& gate_up) {
  expect_f32(gate_up, "swiglu_forward", "gate_up");
  const int64_t N = rows(gate_up), F = cols(gate_up) / 2;
  expect(out.numel() == N * F, "swiglu: out " + sh(out) + " must be half the width of gate_up " + sh(gate_up));
  if (out.dtype() == DType::BF16) {  // fused with the cast for the next GEMM
    auto c = swiglu_bf16_cost(N, F, false);
    Span span(tracer_, "swiglu_fwd_bf16", Category::Kernel, c.flops, c.bytes);
    kernels::swiglu_forward(static_cast<bf16*>(out.raw()), gate_up.data<float>(), N, F);
    return;
  }
  auto c = swiglu_cost(N, F, false);
  Span span(tracer_, "swiglu_fwd", Category::Kernel, c.flops, c.bytes);
  kernels::swiglu_forward(out.data<float>(), gate_up.data<float>(), N, F);
}

void CpuBackend::swiglu_backward(const Tensor& dgate_up, const Tensor& gate_up, const Tensor& dout) {
  const int64_t N = rows(gate_up), F = cols(gate_up) / 2;
  auto c = swiglu_cost(N, F, true);
  Span span(tracer_, "swiglu_bwd", Category::Kernel, c.flops, c.bytes);
  kernels::swiglu_backward(dgate_up.data<float>(), gate_up.data<float>(), dout.data<float>(), N, F);
}

Tensor CpuBackend::activation_backward_output_grad(Activation act, const Tensor& d_pre, const Tensor& pre,
                                                   const Tensor& d_act, const Tensor* db, const Tensor& w) {
  expect_f32(pre, "activation_backward_output_grad", "pre");
  expect_f32(d_act, "activation_backward_output_grad", "d_act");
  const int64_t N = rows(pre), W = cols(pre), F = act == Activation::SwiGLU ? W / 2 : W;
  expect(d_pre.shape() == pre.shape() && rows(d_act) == N && cols(d_act) == F && w.dim(0) == W &&
             (!db || (act == Activation::Gelu && db->numel() == W)),
         "activation_backward_output_grad: d_pre " + sh(d_pre) + ", pre " + sh(pre) + ", d_act " + sh(d_act) +
             ", w " + sh(w) + (db ? ", db " + sh(*db) : "") + " do not fit");
  if (w.dtype() != DType::BF16) {
    // f32 GEMMs read the f32 gradient: the plain backward, then the bias gradient from it.
    if (act == Activation::Gelu)
      gelu_backward(d_pre, pre, d_act);
    else
      swiglu_backward(d_pre, pre, d_act);
    return prepare_output_grad(d_pre, db, w);
  }
  // One pass: the activation's gradient is rounded to bf16 as it is computed (and, for GELU, the bias
  // gradient summed); its f32 value is never stored. Lives in the same scratch as prepare_output_grad's.
  bf16* lowp = static_cast<bf16*>(scratch(sizeof(bf16) * pre.numel()));
  if (act == Activation::Gelu) {
    auto c = gelu_bf16_cost(N, W, true, db != nullptr);
    Span span(tracer_, "gelu_bwd_bf16", Category::Kernel, c.flops, c.bytes);
    kernels::gelu_backward(lowp, db ? db->data<float>() : nullptr, pre.data<float>(), d_act.data<float>(), N, W);
  } else {
    auto c = swiglu_bf16_cost(N, F, true);
    Span span(tracer_, "swiglu_bwd_bf16", Category::Kernel, c.flops, c.bytes);
    kernels::swiglu_backward(lowp, pre.data<float>(), d_act.data<float>(), N, F);
  }
  return Tensor::wrap(lowp, pre.shape(), DType::BF16);
}

void CpuBackend::rope_forward(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const AttentionShape& s) {
  auto c = rope_cost(s.B, s.T, s.H, s.KVH, s.D);
  Span span(tracer_, "rope_fwd", Category::Kernel, c.flops, c.bytes);
  kernels::rope_forward(qkv.data<float>(), cos.data<float>(), sin.data<float>(), s.B, s.T, s.H, s.KVH, s.D);
}

void CpuBackend::rope_backward(const Tensor& dqkv, const Tensor& cos, const Tensor& sin, const AttentionShape& s) {
  auto c = rope_cost(s.B, s.T, s.H, s.KVH, s.D);
  Span span(tracer_, "rope_bwd", Category::Kernel, c.flops, c.bytes);
  kernels::rope_backward(dqkv.data<float>(), cos.data<float>(), sin.data<float>(), s.B, s.T, s.H, s.KVH, s.D);
}

void CpuBackend::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  expect(qkv.numel() == s.B * s.T * (s.H + 2 * s.KVH) * s.D && out.numel() == s.B * s.T * s.H * s.D &&
             lse.numel() == s.B * s.H * s.T,
         "attention: qkv " + sh(qkv) + " / out " + sh(out) + " do not match the attention shape");
  auto c = attention_cost(s, false);
  Span span(tracer_, "attention_fwd", Category::Kernel, c.flops, c.bytes);
  kernels::attention_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), s, alloc_);
}

void CpuBackend::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                                    const Tensor& qkv, const AttentionShape& s) {
  auto c = attention_cost(s, true);
  Span span(tracer_, "attention_bwd", Category::Kernel, c.flops, c.bytes);
  kernels::attention_backward(dqkv.data<float>(), dout.data<float>(), out.data<float>(), lse.data<float>(),
                              qkv.data<float>(), s, alloc_);
}

void CpuBackend::attention_block_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& kv,
                                         const AttentionShape& s) {
  const int64_t Tk = kv.shape().rank() == 3 ? kv.dim(1) : 0;
  expect(kv.shape().rank() == 3 && kv.dim(0) == s.B && kv.dim(2) == 2 * s.KVH * s.D && q.numel() == s.B * s.T * s.H * s.D &&
             out.numel() == q.numel() && lse.numel() == s.B * s.H * s.T,
         "attention_block: q " + sh(q) + " / kv " + sh(kv) + " / out " + sh(out) + " do not match the attention shape");
  auto c = attention_block_cost(s, Tk, false);
  Span span(tracer_, "attention_block_fwd", Category::Kernel, c.flops, c.bytes);
  kernels::attention_block_forward(out.data<float>(), lse.data<float>(), q.data<float>(), kv.data<float>(), Tk, s,
                                   alloc_);
}

void CpuBackend::attention_block_backward(const Tensor& dq, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                                          const Tensor& lse, const Tensor& q, const Tensor& kv, const AttentionShape& s) {
  const int64_t Tk = kv.shape().rank() == 3 ? kv.dim(1) : 0;
  expect(kv.shape().rank() == 3 && dkv.numel() == kv.numel() && dq.numel() == q.numel() && dout.numel() == q.numel() &&
             q.numel() == s.B * s.T * s.H * s.D,
         "attention_block backward: q " + sh(q) + " / kv " + sh(kv) + " do not match the attention shape");
  auto c = attention_block_cost(s, Tk, true);
  Span span(tracer_, "attention_block_bwd", Category::Kernel, c.flops, c.bytes);
  kernels::attention_block_backward(dq.data<float>(), dkv.data<float>(), dout.data<float>(), out.data<float>(),
                                    lse.data<float>(), q.data<float>(), kv.data<float>(), Tk, s, alloc_);
}

void CpuBackend::attention_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                  const DecodeShape& s) {
  expect(q.numel() == s.n * s.H * s.D && out.numel() == q.numel() &&
             k_cache.numel() >= (s.start + s.n) * s.KVH * s.D && v_cache.numel() == k_cache.numel(),
         "attention_decode: q " + sh(q) + " / cache " + sh(k_cache) + " do not fit the decode shape");
  auto c = attention_decode_cost(s);
  Span span(tracer_, "attention_decode", Category::Kernel, c.flops, c.bytes);
  kernels::attention_decode(out.data<float>(), q.data<float>(), k_cache.data<float>(), v_cache.data<float>(), s);
}

void CpuBackend::softmax_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets,
                                       float grad_scale) {
  const int64_t N = rows(logits), V = cols(logits);
  expect(losses.numel() == N && targets.numel() == N && targets.dtype() == DType::I32,
         "softmax_cross_entropy: logits " + sh(logits) + ", targets " + sh(targets) + ", losses " + sh(losses));
  auto c = softmax_cross_entropy_cost(N, V);
  Span span(tracer_, "softmax_xent", Category::Kernel, c.flops, c.bytes);
  kernels::softmax_cross_entropy(losses.data<float>(), logits.data<float>(), targets.data<int32_t>(), N, V,
                                 grad_scale);
}

void CpuBackend::cross_entropy_forward(const Tensor& losses, const Tensor& logits, const Tensor& targets) {
  const int64_t N = rows(logits), V = cols(logits);
  auto c = softmax_cross_entropy_cost(N, V);
  Span span(tracer_, "xent_fwd", Category::Kernel, c.flops, c.bytes);
  kernels::cross_entropy_forward(losses.data<float>(), logits.data<float>(), targets.data<int32_t>(), N, V);
}

void CpuBackend::vocab_parallel_partials(const Tensor& partials, const Tensor& logits, const Tensor& targets,
                                         int64_t vocab_begin, int64_t vocab_size, bool keep_exp) {
  const int64_t N = rows(logits), V = cols(logits);
  expect(partials.numel() == 3 * N && targets.numel() == N && targets.dtype() == DType::I32,
         "vocab_parallel_partials: logits " + sh(logits) + ", targets " + sh(targets) + ", partials " + sh(partials));
  auto c = softmax_cross_entropy_cost(N, V);
  Span span(tracer_, "vocab_xent_partials", Category::Kernel, c.flops, c.bytes);
  kernels::vocab_shard_partials(partials.data<float>(), logits.data<float>(), targets.data<int32_t>(), N, V,
                                vocab_begin, vocab_size, keep_exp);
}

void CpuBackend::vocab_parallel_finish(const Tensor& losses, const Tensor& logits, bool write_grad, const Tensor& targets,
                                       const Tensor& gathered, int rank, int64_t vocab_size, float grad_scale) {
  const int64_t N = targets.numel();
  const int ranks = static_cast<int>(gathered.numel() / (3 * std::max<int64_t>(N, 1)));
  expect(losses.numel() == N && gathered.numel() == 3 * N * ranks && rank >= 0 && rank < ranks,
         "vocab_parallel_finish: losses " + sh(losses) + ", gathered " + sh(gathered));
  const int64_t V = cols(logits);
  auto c = write_grad ? KernelCost{2.0 * N * V, 8.0 * N * V} : KernelCost{4.0 * N * ranks, 12.0 * N * ranks};
  Span span(tracer_, "vocab_xent_finish", Category::Kernel, c.flops, c.bytes);
  kernels::vocab_shard_finish(losses.data<float>(), write_grad ? logits.data<float>() : nullptr,
                              targets.data<int32_t>(), gathered.data<float>(), ranks, rank, N, V, vocab_size,
                              grad_scale);
}

void CpuBackend::cast(const Tensor& out, const Tensor& in) {
  expect(out.numel() == in.numel(), "cast: " + sh(in) + " to " + sh(out) + " changes the element count");
  auto c = cast_cost(in.numel());
  Span span(tracer_, "cast", Category::Kernel, c.flops, c.bytes);
  if (in.dtype() == DType::F32 && out.dtype() == DType::BF16)
    cast_f32_to_bf16(out.data<bf16>(), in.data<float>(), in.numel());
  else if (in.dtype() == DType::BF16 && out.dtype() == DType::F32)
    cast_bf16_to_f32(out.data<float>(), in.data<bf16>(), in.numel());
  else if (in.dtype() == out.dtype())
    out.copy_from(in);
  else
    throw UnsupportedError("cast from " + sh(in) + " to " + sh(out) + " is not supported");
}

void CpuBackend::add(const Tensor& out, const Tensor& a, const Tensor& b) {
  expect(out.numel() == a.numel() && a.numel() == b.numel(), "add: " + sh(a) + " + " + sh(b) + " -> " + sh(out));
  Span span(tracer_, "residual_add", Category::Kernel, static_cast<double>(a.numel()), 12.0 * a.numel());
  kernels::add(out.data<float>(), a.data<float>(), b.data<float>(), a.numel());
}

}  // namespace loom::kernels
