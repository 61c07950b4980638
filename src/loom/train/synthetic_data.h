// A learnable synthetic token stream for runs without a prepared corpus: each sequence follows a
// fixed random "successor" table with probability 7/8 and jumps to a random token otherwise, so a
// model can drive its loss well below log(V). Every token is a pure function of (seed, global sample
// index, position), so the data does not depend on ranks or micro-batching.
#pragma once

#include <cstdint>

#include "loom/core/tensor.h"
#include "loom/train/token_source.h"

namespace loom::train {

class SyntheticData final : public TokenSource {
 public:
  SyntheticData(uint64_t seed, int64_t vocab_size, int64_t seq_len);
  void fill(const Tensor& tokens, const Tensor& targets, int64_t first_sample, Split split) const override;
  std::string describe() const override;
  std::string identity() const override { return "synthetic"; }
  // Validation samples live at indices disjoint from any training run's.
  static constexpr int64_t kValidationOffset = int64_t{1} << 48;
  // Entropy of the generating process per token (nats): the loss floor a perfect model reaches.
  double entropy_floor() const;

 private:
  int32_t successor(int32_t tok) const;
  uint64_t seed_;
  int64_t vocab_, seq_len_;
};

}  // namespace loom::train
