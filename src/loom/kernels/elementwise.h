// Memory-bound kernels of a transformer step, on raw f32 pointers (llm.c style: outputs, then
// saved-for-backward, then inputs, then weights, then dimensions). Each family has a plain reference
// (namespace ref, loops a reader can check against the math) and the fast version used in training
// (OpenMP across rows, vectorised for AVX-512 / AVX2 chosen at run time by target_clones).
//
// Gradient conventions, so the model can chain them without extra passes:
//  * parameter gradients (dweight, dbias, dwte, dwpe) always ACCUMULATE (+=), for gradient accumulation;
//  * norm backward ACCUMULATES into dinp (the residual stream's gradient is a sum of branches);
//  * element-wise activation backward (gelu, swiglu) WRITES dinp (its input has one consumer);
//  * rope works in place.
// Shapes: N = rows (B*T), C = channels, V = vocabulary, F = MLP width.
#pragma once

#include <cstdint>
#include <optional>

#include "loom/core/bf16.h"
#include "loom/kernels/kernel_cost.h"

namespace loom::kernels {

// ---- embedding: out[b,t,:] = wte[tokens[b,t],:] (+ wpe[t,:] when wpe != nullptr) ----
// A negative token reads a zero row and its gradient goes nowhere: under a vocabulary-parallel
// embedding it belongs to another rank's rows.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C);
// The same from bf16 weights (precision = "bf16-pure"), widened exactly.
void embedding_forward(float* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int64_t B, int64_t T,
                       int64_t C);
// dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += sum_b dout[b,t,:] (dwpe may be nullptr).
// Deterministic: the same inputs give bitwise the same result for a given thread count.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C);
KernelCost embedding_cost(int64_t N, int64_t C);

// ---- LayerNorm over the last dim: out = (x - mean) * rstd * weight + bias; saves mean, rstd [N] ----
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C);
KernelCost layernorm_cost(int64_t N, int64_t C, bool backward);

// ---- RMSNorm: out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps); saves rstd [N] ----
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C);
KernelCost rmsnorm_cost(int64_t N, int64_t C, bool backward);

// ---- The instruction path of the activations (GELU, SwiGLU, and their fused bf16 casts) and of the
// f32 -> bf16 casts: AVX-512 intrinsics (activations: exp as 2^z by VSCALEFPS, about 2x the portable
// loops where they are compute-bound; casts: rounded in registers in one pass with the bias gradient's
// sums) where the CPU, capped by LOOM_MAX_CPU_ISA / DNNL_MAX_CPU_ISA, has AVX-512F; else the portable
// loops, compiled per ISA (target_clones). The activations agree with float64 to ~5e-6 relative on
// both, not bit for bit; the casts are bit for bit the same. ----
enum class ElementwisePath { Portable, Avx512 };
const char* elementwise_path_name(ElementwisePath p);  // "portable", "avx512"
ElementwisePath elementwise_path();                    // what the next call runs
// Tests: every such kernel runs on `p` until called again with std::nullopt; throws if this CPU (and
// the ISA cap) cannot run it.
void force_elementwise_path(std::optional<ElementwisePath> p);

// ---- GELU, tanh approximation (GPT-2's "gelu_new"), element-wise over n values ----
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
KernelCost gelu_cost(int64_t n, bool backward);
// Fused with the bf16 cast the next GEMM needs (precision bf16, where the f32 result has no other reader):
// forward writes gelu(x) in bf16; backward writes the [N, F] input gradient in bf16 and, when dbias is
// non-null, adds its column sums (f32, before rounding) to dbias -- the bias gradient of the linear
// whose output x is (summed as bias_backward sums). The same math as the f32 kernels; an element may
// differ from the cast of theirs by one bf16 step where FMA contraction differs (a loop's tail).
void gelu_forward(bf16* out, const float* inp, int64_t n);
void gelu_backward(bf16* dinp, float* dbias, const float* inp, const float* dout, int64_t N, int64_t F);
KernelCost gelu_bf16_cost(int64_t N, int64_t F, bool backward, bool bias);

// ---- SwiGLU: gu is [N, 2F] with gate in columns [0, F) and up in [F, 2F); out[N, F] = silu(gate) * up ----
void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F);
void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t F);
KernelCost swiglu_cost(int64_t N, int64_t F, bool backward);
// Fused with the bf16 cast, as GELU's: the product, or both gradients, written in bf16 only.
void swiglu_forward(bf16* out, const float* gu, int64_t N, int64_t F);
void swiglu_backward(bf16* dgu, const float* gu, const float* dout, int64_t N, int64_t F);
KernelCost swiglu_bf16_cost(int64_t N, int64_t F, bool backward);

// ---- Rotary position embedding, Hugging Face Llama convention (rotate_half: element i pairs with
// i + D/2 within a head). qkv is [B, T, (H + 2*KVH) * D]: q heads, then k heads, then v heads per row.
// cos/sin tables are [T, D/2] with angle t * theta^(-2i/D). Forward rotates q and k in place;
// backward applies the inverse rotation to the gradient in place (v untouched in both). ----
void rope_tables(float* cos, float* sin, int64_t T, int64_t D, float theta);
void rope_forward(float* qkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                  int64_t D);
void rope_backward(float* dqkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                   int64_t D);
KernelCost rope_cost(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D);

// ---- Fused softmax + cross-entropy, forward and backward in one pass over the logits.
// logits [N, V] are overwritten with dlogits = (softmax - onehot(target)) * grad_scale; losses[n] gets
// -log softmax[target]. A target < 0 is ignored: loss 0 and zero gradient for that row. ----
void softmax_cross_entropy(float* losses, float* logits_to_dlogits, const int32_t* targets, int64_t N, int64_t V,
                           float grad_scale);
// Forward only (validation): losses[n], logits untouched.
void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V);
KernelCost softmax_cross_entropy_cost(int64_t N, int64_t V);

// ---- Vocabulary-parallel cross-entropy: each of R ranks holds logits [N, V] for vocabulary entries
// [rank * V, rank * V + V) (the last rank's tail past vocab_size is padding). Two halves around one
// all-gather of per-row partials, so the full logits are never gathered:
//   partials[n] = {max, sum exp(x - max), x[target] or 0} over this rank's valid columns; with
//   `keep_exp` the logits are overwritten with exp(x - max) for the finish.
//   finish: combines every rank's partials (gathered [R, N, 3], in rank order: the same result on every
//   rank), writes losses[n] = -log softmax[target] and, when dlogits is given (the exp values from
//   `keep_exp`), dlogits = (softmax - onehot) * grad_scale for this rank's columns (padding: 0). ----
void vocab_shard_partials(float* partials, float* logits, const int32_t* targets, int64_t N, int64_t V,
                          int64_t vocab_begin, int64_t vocab_size, bool keep_exp);
void vocab_shard_finish(float* losses, float* dlogits, const int32_t* targets, const float* gathered, int ranks,
                        int rank, int64_t N, int64_t V, int64_t vocab_size, float grad_scale);

// ---- bias gradient: dbias[j] += sum_n dout[n, j], summed over fixed blocks of rows (bitwise the same for
// any thread count, and as the fused dY cast and GELU backward sum it) ----
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC);
KernelCost bias_backward_cost(int64_t N, int64_t OC);

// ---- fused AdamW (decoupled weight decay, Loshchilov & Hutter) on fp32 masters:
//   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   param -= lr * ( (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps) + weight_decay * param )
// When param_bf16 != nullptr the updated param is also written there rounded to nearest-even bf16,
// saving a separate cast pass. step counts from 1. ----
void adamw_update(float* param, float* m, float* v, bf16* param_bf16, const float* grad, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale);
KernelCost adamw_cost(int64_t n);

// ---- sum of squares in double, for the global gradient norm (deterministic for a thread count) ----
double sum_squares(const float* x, int64_t n);
KernelCost sum_squares_cost(int64_t n);
// ---- x[0, n) = 0 on every thread (the gradient accumulators at the start of a step) ----
void fill_zero(float* x, int64_t n);
KernelCost fill_zero_cost(int64_t n);
// ---- first non-finite element's index, or -1 ----
int64_t find_non_finite(const float* x, int64_t n);

// ---- casts ----
void cast_f32_to_bf16(bf16* out, const float* inp, int64_t n);
// Stochastic rounding (precision = "bf16-sr"): element i of a run gets the 16 random low bits of
// Philox(key, stream, (first + i) / 8), 16-bit lane (first + i) % 8, added before truncation, so
// E[bf16(x)] = x and the bits are a pure function of the element's global index `first + i`: every
// layout rounds an element alike.
struct StochasticRounding {
  uint64_t key = 0, stream = 0;
  int64_t first = 0;
};
void cast_f32_to_bf16_stochastic(bf16* out, const float* inp, int64_t n, const StochasticRounding& sr);

// ---- AdamW on bf16 weights and moments (precision = "bf16-pure"): the same update computed in f32
// from the widened values, then weight, m and v each rounded stochastically back to bf16 -- weight
// under `sr`, m and v under `sr` with their streams moved by kMomentStream1/2, so all three are keyed by
// the element's global index -- or, with sr == nullptr (vocabulary padding), to nearest. ----
inline constexpr uint64_t kMomentStream1 = 0x6578'705f'6176'6731ull, kMomentStream2 = 0x6578'705f'6176'6732ull;
void adamw_update_bf16(bf16* param, bf16* m, bf16* v, const float* grad, int64_t n, float lr, float beta1, float beta2,
                       float eps, float weight_decay, int64_t step, float grad_scale, const StochasticRounding* sr);
// Bytes: read weight, m, v (2 each) and grad (4), write weight, m, v.
KernelCost adamw_bf16_cost(int64_t n);
// A linear layer's output gradient dy[N, OC] cast to bf16 for its two GEMMs, with the bias gradient
// (dbias += column sums of dy, in f32) taken in the same pass: one read of dy instead of two.
void cast_f32_to_bf16_bias_grad(bf16* out, float* dbias, const float* dy, int64_t N, int64_t OC);
KernelCost cast_bias_grad_cost(int64_t N, int64_t OC);
void cast_bf16_to_f32(float* out, const bf16* inp, int64_t n);
// Rounds f32 values to the nearest bf16 in place (the bf16 fallback on CPUs without bf16 GEMMs).
void round_to_bf16_inplace(float* x, int64_t n);
// y = a + b element-wise (residual connections)
void add(float* out, const float* a, const float* b, int64_t n);
KernelCost cast_cost(int64_t n);

namespace ref {
// Plain fp32 references of the kernels above, same signatures and conventions. Kept forever as the
// oracle the fast versions are tested against.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C);
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C);
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C);
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F);
void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t F);
void rope_forward(float* qkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                  int64_t D);
void rope_backward(float* dqkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                   int64_t D);
void softmax_cross_entropy(float* losses, float* logits_to_dlogits, const int32_t* targets, int64_t N, int64_t V,
                           float grad_scale);
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC);
void adamw_update(float* param, float* m, float* v, bf16* param_bf16, const float* grad, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale);
}  // namespace ref

}  // namespace loom::kernels
