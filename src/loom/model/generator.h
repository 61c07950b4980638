// Autoregressive inference with a KV cache: each token runs through the blocks once; keys and values
// of every earlier position are kept per layer, so a new token costs O(T) attention work instead of
// re-running the whole prefix. Batch 1, fp32 weights (the masters of a checkpoint). The blocks run
// through the same code as training (model::BlockRunner, bound by model::bind_weights); only the
// attention step differs: the new rows attend to the cache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "loom/kernels/backend.h"
#include "loom/model/block.h"
#include "loom/model/parameter_store.h"
#include "loom/spec/transformer_config.h"

namespace loom::model {

class Generator {
 public:
  Generator(spec::TransformerConfig cfg, const ParameterStore& params, kernels::Backend& backend);
  ~Generator();

  // Appends `tokens` at the current position and returns the logits [V] after the last of them.
  // Throws ConfigError when the context (model.max_seq) would overflow or a token is out of range.
  std::span<const float> feed(std::span<const int32_t> tokens);
  void reset() { position_ = 0; }
  int64_t position() const { return position_; }
  // Token rows run through the blocks so far: prompt length + one per generated token with the
  // cache (a recomputing decoder would grow quadratically).
  int64_t rows_computed() const { return rows_computed_; }

 private:
  class CachedAttention;

  spec::TransformerConfig cfg_;
  kernels::Backend& backend_;
  bool llama_;
  std::unique_ptr<kernels::LayerOps> ops_;  // the whole model, locally
  LocalWidths local_;
  ModelWeights w_;
  RopeTables rope_;
  std::unique_ptr<BlockRunner> runner_;
  std::vector<Tensor> k_cache_, v_cache_;  // per layer [max_seq, KV * D]
  // Scratch for up to max_seq rows: one block's activations, the residual stream in and out, the
  // last row's norm and the logits.
  BlockActivations scratch_;
  Tensor tokens_, x_[2], mean_, rstd_, h_, q_, logits_;
  int64_t position_ = 0;
  int64_t rows_computed_ = 0;
};

}  // namespace loom::model
