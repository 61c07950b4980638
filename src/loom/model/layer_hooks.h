// Calls around each parameter unit's use in forward and backward, so whoever owns the weights can
// gather them just before they are read (ZeRO-3) and reduce gradients as soon as they are final
// (DDP buckets, ZeRO-1/2), while the model itself knows nothing of parallelism.
#pragma once

#include <cstdint>

namespace loom::model {

// Units: -1 the embeddings, 0 .. n_layers-1 the blocks, n_layers the final norm and LM head. A tied
// head reads the embedding unit's weight inside unit n_layers, and its gradient adds into the
// embedding's, which is final only after after_backward(-1).
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual void before_forward(int64_t /*unit*/) {}
  virtual void after_forward(int64_t /*unit*/) {}
  virtual void before_backward(int64_t /*unit*/) {}
  // The unit's own parameter gradients are final (for this micro-batch).
  virtual void after_backward(int64_t /*unit*/) {}
};

}  // namespace loom::model
