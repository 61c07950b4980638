// Attention for incremental decoding with a KV cache: `n` new query rows at positions
// start .. start + n - 1 attend causally over the cached keys and values of positions 0 .. start + n - 1.
// Used by generation, where recomputing the whole prefix per token would cost O(T^2) GEMMs.
//
// Layout (batch 1): q is [n, H * D]; k_cache and v_cache are [capacity, KVH * D], rows filled up to
// start + n; out is [n, H * D]. Query head h reads kv head h / (H / KVH), as in training.
#pragma once

#include <cstdint>

#include "loom/kernels/kernel_cost.h"

namespace loom::kernels {

struct DecodeShape {
  int64_t n = 1, start = 0, H = 1, KVH = 1, D = 1;
  float scale = 0;
};

void attention_decode(float* out, const float* q, const float* k_cache, const float* v_cache, const DecodeShape& s);
KernelCost attention_decode_cost(const DecodeShape& s);

}  // namespace loom::kernels
