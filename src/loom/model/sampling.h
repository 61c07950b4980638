// Picks the next token from logits: greedy at temperature 0, else softmax(logits / temperature)
// restricted to the top-k, sampled with Philox keyed by (seed, index) so a generation is
// reproducible from its seed.
#pragma once

#include <cstdint>
#include <span>

namespace loom::model {

struct SamplingOptions {
  float temperature = 0.8f;
  int top_k = 40;  // 0: the whole vocabulary
  uint64_t seed = 1;
};

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, uint64_t index);

}  // namespace loom::model
