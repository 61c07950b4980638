// GEMM through oneDNN's matmul: C[M,N] (+)= op(A)[M,K] . op(B)[K,N] (+ bias[N]), f32 or
// bf16-in / f32-accumulate. A shape is described once and its primitive created once (a cache keyed
// by the description); oneDNN chooses AMX / AVX-512 / AVX2 code at run time.
//
// Where the CPU has no bf16 instructions, oneDNN 2.6 refuses bf16 matmuls; Loom then widens the
// bf16 operands to f32 and runs an f32 GEMM -- the same numbers (bf16-rounded inputs, f32
// accumulation), only slower -- and says so once at start-up (gemm_bf16_mode()).
#pragma once

#include <cstdint>
#include <string>

#include "loom/core/allocator.h"
#include "loom/core/dtype.h"
#include "loom/kernels/kernel_cost.h"

namespace loom::kernels {

struct GemmDesc {
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false;      // A is stored [K, M] row-major
  bool trans_b = false;      // B is stored [N, K] row-major (a torch.nn.Linear weight for x . W^T)
  DType ab_type = DType::F32;  // F32 or BF16 for both A and B; C is always F32
  bool accumulate = false;   // C += result (gradient accumulation) instead of C = result
  bool bias = false;         // add bias[N] (F32) to each row
  // C = result + R for an [M, N] f32 R (row stride N) read in the epilogue (oneDNN's binary post-op):
  // a residual connection without copying R into C first. Not with `accumulate` or `runtime_shape`.
  bool residual = false;
  // The shape changes from call to call (a mixture of experts' rows per expert): one primitive with
  // run-time dimensions serves every shape of these flags, instead of one primitive -- and its JIT
  // compilation, ~1 ms -- per shape (measured: new primitive per call 283 GFLOP/s, run-time shape
  // 540-680, a cached fixed shape 625, bf16 on the AVX512-BF16 EPYC; bench/moe.sh).
  bool runtime_shape = false;

  bool operator==(const GemmDesc&) const = default;
  std::string str() const;
};

// The three GEMMs of a linear layer y[rows, out] = x[rows, in] . w[out, in]^T (w a torch.nn.Linear
// weight) as the CPU backend calls them: the forward reads w transposed, dX = dY . w, and dW += dY^T . x
// reads dY transposed and accumulates into the gradient. One definition for the backend and for
// `loom calibrate`, so the calibration times the calls a step makes: oneDNN's code for a transposed
// operand or an accumulating epilogue is not the plain GEMM's (the planner's one-rank prediction had
// read 10% fast while the calibration timed plain [M, N, K] GEMMs in place of these).
struct LinearGemms {
  GemmDesc forward, backward_data, backward_weight;
};
LinearGemms linear_gemms(int64_t rows, int64_t out_features, int64_t in_features, DType dtype);

// Runs the GEMM. `workspace` is used only by the bf16 fallback (widened operands); `residual` is R of
// GemmDesc::residual (may not alias C).
void gemm(const GemmDesc& d, const void* A, const void* B, float* C, const float* bias, Allocator& workspace,
          const float* residual = nullptr);
KernelCost gemm_cost(const GemmDesc& d);

enum class Bf16GemmMode { Native, WidenToF32 };
// Whether oneDNN runs bf16 matmuls on this CPU (probed once by creating a bf16 primitive).
Bf16GemmMode gemm_bf16_mode();
// oneDNN's name for the implementation it picks for a representative f32 or bf16 matmul,
// e.g. "brg:avx512_core_amx" -- reported at start-up.
std::string gemm_impl_name(DType ab_type);

// Plain triple loop in f32 (reads bf16 operands when ab_type is BF16): the oracle for tests.
void gemm_reference(const GemmDesc& d, const void* A, const void* B, float* C, const float* bias,
                    const float* residual = nullptr);

}  // namespace loom::kernels
