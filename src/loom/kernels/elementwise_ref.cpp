// Plain fp32 references of the element-wise kernels (llm.c's train_gpt2.c style): one loop nest per
// formula, no threads, no tricks, so that a reader can check each line against the math. They are the
// oracle the fast versions in norms.cpp, activations.cpp, rope.cpp, loss.cpp, optimizer_kernels.cpp
// and elementwise.cpp are tested against; keep them slow and obvious.
#include <cmath>

#include "loom/kernels/elementwise.h"

namespace loom::kernels::ref {

// out[b,t,c] = wte[tokens[b,t], c] + wpe[t, c]
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      float* o = out + (b * T + t) * C;
      const int32_t tok = tokens[b * T + t];
      for (int64_t c = 0; c < C; ++c) {
        const float w = tok >= 0 ? wte[static_cast<int64_t>(tok) * C + c] : 0.0f;
        o[c] = wpe ? w + wpe[t * C + c] : w;
      }
    }
  }
}

// The embedding is a lookup, so its gradient is a scatter-add of dout rows into the looked-up rows.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* d = dout + (b * T + t) * C;
      const int32_t tok = tokens[b * T + t];
      for (int64_t c = 0; c < C; ++c) {
        if (tok >= 0) dwte[static_cast<int64_t>(tok) * C + c] += d[c];
        if (dwpe) dwpe[t * C + c] += d[c];
      }
    }
  }
}

// LayerNorm (GPT-2): mean and biased variance over C, eps inside the square root.
//   norm = (x - mean) * rstd, rstd = 1 / sqrt(var + eps), out = norm * weight + bias
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float m = 0.0f;
    for (int64_t c = 0; c < C; ++c) m += x[c];
    m /= static_cast<float>(C);
    float var = 0.0f;
    for (int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    var /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(var + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

// With dnorm = dout * weight, the chain rule through mean and rstd gives
//   dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)).
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float dnorm_mean = 0.0f;
    float dnorm_norm_mean = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - mean[n]) * rstd[n];
      const float dnorm = weight[c] * dy[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - mean[n]) * rstd[n];
      const float dnorm = weight[c] * dy[c];
      dbias[c] += dy[c];
      dweight[c] += norm * dy[c];
      dinp[n * C + c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n];
    }
  }
}

// RMSNorm (Llama): no centring and no bias. out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float ms = 0.0f;
    for (int64_t c = 0; c < C; ++c) ms += x[c] * x[c];
    ms /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(ms + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

// d rstd / d x_j = -rstd^3 x_j / C, so with norm = x * rstd and dnorm = dout * weight:
//   dx = rstd * (dnorm - norm * mean(dnorm * norm)).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float dnorm_norm_mean = 0.0f;
    for (int64_t c = 0; c < C; ++c) dnorm_norm_mean += weight[c] * dy[c] * x[c] * rstd[n];
    dnorm_norm_mean /= static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) {
      const float norm = x[c] * rstd[n];
      dweight[c] += norm * dy[c];
      dinp[n * C + c] += (weight[c] * dy[c] - norm * dnorm_norm_mean) * rstd[n];
    }
  }
}

// GELU, tanh approximation: 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi).
namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + kGeluCubic * x * x * x)));
  }
}

// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 * 0.044715 x^2), u = k (x + 0.044715 x^3)
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float th = std::tanh(kGeluScale * (x + kGeluCubic * x * x * x));
    const float du_dx = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    dinp[i] = (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du_dx) * dout[i];
  }
}

// SwiGLU: out = silu(gate) * up, silu(g) = g * sigmoid(g); gate is gu[:, 0:F], up is gu[:, F:2F].
void swiglu_forward(float* out, const float* gu, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const float g = gu[n * 2 * F + f];
      const float u = gu[n * 2 * F + F + f];
      out[n * F + f] = g / (1.0f + std::exp(-g)) * u;
    }
  }
}

// d silu(g) / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))); d out / d up = silu(g).
void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const float g = gu[n * 2 * F + f];
      const float u = gu[n * 2 * F + F + f];
      const float sig = 1.0f / (1.0f + std::exp(-g));
      const float dy = dout[n * F + f];
      dgu[n * 2 * F + f] = dy * u * sig * (1.0f + g * (1.0f - sig));
      dgu[n * 2 * F + F + f] = dy * g * sig;
    }
  }
}

// RoPE, rotate_half convention: within a head, element i pairs with i + D/2 and the pair turns by
// the angle in cos/sin[t, i]:
//   out[i] = x[i] cos - x[i + D/2] sin,   out[i + D/2] = x[i + D/2] cos + x[i] sin.
// Applied to the H query heads and KVH key heads of each row; the KVH value heads are left alone.
void rope_forward(float* qkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                  int64_t D) {
  const int64_t row = (H + 2 * KVH) * D;
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H + KVH; ++h) {
        float* x = qkv + (b * T + t) * row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float c = cos[t * half + i];
          const float s = sin[t * half + i];
          const float x1 = x[i];
          const float x2 = x[i + half];
          x[i] = x1 * c - x2 * s;
          x[i + half] = x2 * c + x1 * s;
        }
      }
    }
  }
}

// The rotation is orthogonal, so the gradient goes through its transpose: the rotation by -angle.
void rope_backward(float* dqkv, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t KVH,
                   int64_t D) {
  const int64_t row = (H + 2 * KVH) * D;
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H + KVH; ++h) {
        float* dx = dqkv + (b * T + t) * row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float c = cos[t * half + i];
          const float s = sin[t * half + i];
          const float d1 = dx[i];
          const float d2 = dx[i + half];
          dx[i] = d1 * c + d2 * s;
          dx[i + half] = d2 * c - d1 * s;
        }
      }
    }
  }
}

// Softmax cross-entropy per row, shifted by the row max so that exp never overflows:
//   loss = log(sum_j exp(x_j - max)) - (x_target - max),  dlogits = (softmax - onehot) * grad_scale.
void softmax_cross_entropy(float* losses, float* logits_to_dlogits, const int32_t* targets, int64_t N, int64_t V,
                           float grad_scale) {
  for (int64_t n = 0; n < N; ++n) {
    float* x = logits_to_dlogits + n * V;
    const int32_t target = targets[n];
    if (target < 0) {  // ignored position (padding): contributes nothing
      losses[n] = 0.0f;
      for (int64_t v = 0; v < V; ++v) x[v] = 0.0f;
      continue;
    }
    float maxv = x[0];
    for (int64_t v = 1; v < V; ++v) maxv = std::fmax(maxv, x[v]);
    // The sum in double: a sequential float sum over V = 8192+ terms drifts by ~1e-5 relative, which
    // would make the oracle less accurate than the kernels it checks.
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(x[v] - maxv);
    losses[n] = static_cast<float>(std::log(sum) - (x[target] - maxv));
    for (int64_t v = 0; v < V; ++v) {
      const float p = static_cast<float>(std::exp(x[v] - maxv) / sum);
      x[v] = (p - (v == target ? 1.0f : 0.0f)) * grad_scale;
    }
  }
}

// dbias[j] += sum over rows of dout[n, j]
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < OC; ++j) dbias[j] += dout[n * OC + j];
  }
}

// AdamW exactly as documented in elementwise.h: bias-corrected moments, decoupled weight decay
// applied to the parameter value before this step's update.
void adamw_update(float* param, float* m, float* v, bf16* param_bf16, const float* grad, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale) {
  // beta^step in double: for beta2 = 0.999 the correction is 1 - (a number close to 1) early on.
  const float bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), step));
  const float bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), step));
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    const float m_hat = m[i] / bias_correction1;
    const float v_hat = v[i] / bias_correction2;
    param[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * param[i]);
    if (param_bf16) param_bf16[i] = f32_to_bf16(param[i]);
  }
}

}  // namespace loom::kernels::ref
