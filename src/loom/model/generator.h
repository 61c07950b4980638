// Autoregressive inference with a KV cache: each token runs through the blocks once; keys and values
// of every earlier position are kept per layer, so a new token costs O(T) attention work instead of
// re-running the whole prefix. Batch 1, fp32 weights (the masters of a checkpoint).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "loom/kernels/backend.h"
#include "loom/model/parameter_store.h"
#include "loom/spec/transformer_config.h"

namespace loom::model {

class Generator {
 public:
  Generator(spec::TransformerConfig cfg, const ParameterStore& params, kernels::Backend& backend);

  // Appends `tokens` at the current position and returns the logits [V] after the last of them.
  // Throws ConfigError when the context (model.max_seq) would overflow or a token is out of range.
  std::span<const float> feed(std::span<const int32_t> tokens);
  void reset() { position_ = 0; }
  int64_t position() const { return position_; }
  // Token rows run through the blocks so far: prompt length + one per generated token with the
  // cache (a recomputing decoder would grow quadratically).
  int64_t rows_computed() const { return rows_computed_; }

 private:
  struct Layer {
    Tensor n1_w, n1_b, qkv_w, qkv_b, out_w, out_b, n2_w, n2_b, up_w, up_b, down_w, down_b;
    Tensor k_cache, v_cache;  // [max_seq, KVH * D]
  };
  void norm(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& b, int64_t n);

  spec::TransformerConfig cfg_;
  kernels::Backend& backend_;
  bool llama_;
  Tensor wte_, wpe_, nf_w_, nf_b_, head_w_;
  std::vector<Layer> layers_;
  Tensor rope_cos_, rope_sin_;
  // Scratch for up to max_seq rows.
  Tensor tokens_, x_, h_, qkv_, q_, att_, up_, act_, mean_, rstd_, logits_;
  int64_t position_ = 0;
  int64_t rows_computed_ = 0;
};

}  // namespace loom::model
