#include "loom/kernels/gemm.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

#include "loom/core/bf16.h"
#include "loom/error.h"

namespace loom::kernels {

namespace {

struct DescHash {
  size_t operator()(const GemmDesc& d) const {
    size_t h = std::hash<int64_t>()(d.M);
    h = h * 1000003u ^ std::hash<int64_t>()(d.N);
    h = h * 1000003u ^ std::hash<int64_t>()(d.K);
    h = h * 31u + (d.trans_a ? 1u : 0u) + (d.trans_b ? 2u : 0u) + (d.accumulate ? 4u : 0u) + (d.bias ? 8u : 0u) +
        (d.runtime_shape ? 16u : 0u) + (d.residual ? 32u : 0u) + (static_cast<size_t>(d.ab_type) << 6);
    return h;
  }
};

// One engine and stream per process: oneDNN's CPU engine is stateless apart from its thread pool.
struct Engine {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};

Engine& engine() {
  static Engine e;
  return e;
}

using dt = dnnl::memory::data_type;

dt to_dnnl(DType t) {
  if (t == DType::F32) return dt::f32;
  if (t == DType::BF16) return dt::bf16;
  throw UnsupportedError("gemm supports f32 and bf16 operands, not " + std::string(dtype_name(t)));
}

struct Prepared {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, bias, residual;
};

// The operands' memory descriptions: row-major storage, a transpose just swapped strides (no copy is
// ever made). With run-time dimensions every size and stride is DNNL_RUNTIME_DIM_VAL.
struct Descs {
  dnnl::memory::desc a, b, c, bias, residual;
};
Descs describe(const GemmDesc& d, DType ab, bool runtime) {
  using dims = dnnl::memory::dims;
  const auto t = to_dnnl(ab);
  const int64_t R = DNNL_RUNTIME_DIM_VAL;
  const int64_t M = runtime ? R : d.M, N = runtime ? R : d.N, K = runtime ? R : d.K;
  Descs s;
  s.a = dnnl::memory::desc({M, K}, t, d.trans_a ? dims{1, M} : dims{K, 1});
  s.b = dnnl::memory::desc({K, N}, t, d.trans_b ? dims{1, K} : dims{N, 1});
  s.c = dnnl::memory::desc({M, N}, dt::f32, dims{N, 1});
  if (d.bias) s.bias = dnnl::memory::desc({1, N}, dt::f32, dims{N, 1});
  if (d.residual) s.residual = s.c;
  return s;
}

Prepared make_primitive(const GemmDesc& d, DType ab) {
  const Descs s = describe(d, ab, d.runtime_shape);
  const auto &a = s.a, &b = s.b, &c = s.c, &bias = s.bias;
  dnnl::primitive_attr attr;
  if (d.accumulate || d.residual) {
    // Either adds what C held (sum) or another tensor (binary add), after the bias: the same one
    // addition per element either way, so a residual read here rounds as a copy into C then += would.
    dnnl::post_ops po;
    if (d.accumulate)
      po.append_sum(1.0f);
    else
      po.append_binary(dnnl::algorithm::binary_add, s.residual);
    attr.set_post_ops(po);
  }
  auto op = d.bias ? dnnl::matmul::desc(a, b, bias, c) : dnnl::matmul::desc(a, b, c);
  dnnl::matmul::primitive_desc pd(op, attr, engine().engine);
  return {dnnl::matmul(pd), a, b, c, bias, s.residual};
}

class PrimitiveCache {
 public:
  const Prepared& get(const GemmDesc& d, DType ab) {
    GemmDesc key = d;
    key.ab_type = ab;
    if (key.runtime_shape) key.M = key.N = key.K = 0;  // one primitive for every shape
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it == cache_.end()) it = cache_.emplace(key, make_primitive(d, ab)).first;
    return it->second;
  }

 private:
  std::mutex mu_;
  std::unordered_map<GemmDesc, Prepared, DescHash> cache_;
};

PrimitiveCache& cache() {
  static PrimitiveCache c;
  return c;
}

Bf16GemmMode probe_bf16() {
  try {
    GemmDesc d{.M = 64, .N = 64, .K = 64, .ab_type = DType::BF16};
    make_primitive(d, DType::BF16);
    return Bf16GemmMode::Native;
  } catch (const dnnl::error&) {
    return Bf16GemmMode::WidenToF32;
  }
}

void widen(float* out, const bf16* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

}  // namespace

std::string GemmDesc::str() const {
  return "gemm M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
         (trans_a ? " A^T" : "") + (trans_b ? " B^T" : "") + " " + std::string(dtype_name(ab_type)) +
         (accumulate ? " +=" : "") + (residual ? " +R" : "");
}

LinearGemms linear_gemms(int64_t rows, int64_t out_features, int64_t in_features, DType dtype) {
  return {.forward = {.M = rows, .N = out_features, .K = in_features, .trans_b = true, .ab_type = dtype},
          .backward_data = {.M = rows, .N = in_features, .K = out_features, .ab_type = dtype},
          .backward_weight = {.M = out_features, .N = in_features, .K = rows, .trans_a = true, .ab_type = dtype,
                              .accumulate = true}};
}

Bf16GemmMode gemm_bf16_mode() {
  static const Bf16GemmMode mode = probe_bf16();
  return mode;
}

std::string gemm_impl_name(DType ab_type) {
  if (ab_type == DType::BF16 && gemm_bf16_mode() == Bf16GemmMode::WidenToF32) return "f32 fallback (no bf16 ISA)";
  try {
    GemmDesc d{.M = 2048, .N = 1536, .K = 384, .trans_b = true, .ab_type = ab_type};
    auto p = make_primitive(d, ab_type);
    const char* name = nullptr;
    dnnl_primitive_desc_query(p.prim.get_primitive_desc(), dnnl_query_impl_info_str, 0, &name);
    return name ? name : "unknown";
  } catch (const dnnl::error& e) {
    return std::string("unavailable: ") + e.what();
  }
}

void gemm(const GemmDesc& d, const void* A, const void* B, float* C, const float* bias, Allocator& workspace,
          const float* residual) {
  if (d.M <= 0 || d.N <= 0 || d.K <= 0) {
    if (d.M < 0 || d.N < 0 || d.K < 0) throw ShapeError("negative dimension in " + d.str());
    if (!d.accumulate && d.M > 0 && d.N > 0) std::memset(C, 0, sizeof(float) * d.M * d.N);
    return;
  }
  if (d.residual && (d.accumulate || d.runtime_shape || residual == nullptr || residual == C))
    throw ShapeError(d.str() + ": a residual epilogue needs its own [M, N] tensor, a fixed shape and no accumulation");
  if (A == nullptr || B == nullptr || C == nullptr || (d.bias && bias == nullptr))
    throw ShapeError(d.str() + ": an operand pointer is null (A " + std::to_string(A != nullptr) + " B " + std::to_string(B != nullptr) + " C " + std::to_string(C != nullptr) + ")");
  DType ab = d.ab_type;
  Buffer wa, wb;
  if (ab == DType::BF16 && gemm_bf16_mode() == Bf16GemmMode::WidenToF32) {
    wa = Buffer(workspace, sizeof(float) * d.M * d.K, MemCategory::Workspace);
    wb = Buffer(workspace, sizeof(float) * d.K * d.N, MemCategory::Workspace);
    widen(static_cast<float*>(wa.data()), static_cast<const bf16*>(A), d.M * d.K);
    widen(static_cast<float*>(wb.data()), static_cast<const bf16*>(B), d.K * d.N);
    A = wa.data();
    B = wb.data();
    ab = DType::F32;
  }
  const Prepared& p = cache().get(d, ab);
  auto& e = engine();
  // A run-time-shaped primitive executes on memory described with this call's sizes.
  const Descs s = d.runtime_shape ? describe(d, ab, false) : Descs{p.a, p.b, p.c, p.bias, p.residual};
  dnnl::memory ma(s.a, e.engine, const_cast<void*>(A));
  dnnl::memory mb(s.b, e.engine, const_cast<void*>(B));
  dnnl::memory mc(s.c, e.engine, C);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
  if (d.bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(s.bias, e.engine, const_cast<float*>(bias)));
  if (d.residual)
    args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                 dnnl::memory(s.residual, e.engine, const_cast<float*>(residual)));
  p.prim.execute(e.stream, args);
  e.stream.wait();
}

KernelCost gemm_cost(const GemmDesc& d) {
  double elt = d.ab_type == DType::BF16 ? 2.0 : 4.0;
  double bytes = elt * static_cast<double>(d.M * d.K + d.K * d.N) + 4.0 * d.M * d.N * (d.accumulate || d.residual ? 2 : 1);
  return {2.0 * d.M * d.N * d.K, bytes};
}

void gemm_reference(const GemmDesc& d, const void* A, const void* B, float* C, const float* bias,
                    const float* residual) {
  auto load = [&](const void* p, int64_t idx) {
    return d.ab_type == DType::BF16 ? bf16_to_f32(static_cast<const bf16*>(p)[idx]) : static_cast<const float*>(p)[idx];
  };
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t n = 0; n < d.N; ++n) {
      float acc = 0;
      for (int64_t k = 0; k < d.K; ++k) {
        float a = load(A, d.trans_a ? k * d.M + m : m * d.K + k);
        float b = load(B, d.trans_b ? n * d.K + k : k * d.N + n);
        acc += a * b;
      }
      if (d.bias) acc += bias[n];
      if (d.residual) acc += residual[m * d.N + n];
      C[m * d.N + n] = d.accumulate ? C[m * d.N + n] + acc : acc;
    }
}

}  // namespace loom::kernels
