#include "loom/train/synthetic_data.h"

#include <cmath>

#include "loom/core/philox.h"
#include "loom/error.h"

namespace loom::train {

namespace {
constexpr uint64_t kTableStream = 0x5ca1ab1eull;
constexpr uint64_t kDataStream = 0xda7aull;
}  // namespace

SyntheticData::SyntheticData(uint64_t seed, int64_t vocab_size, int64_t seq_len)
    : seed_(seed), vocab_(vocab_size), seq_len_(seq_len) {
  if (vocab_size < 2) throw ConfigError("synthetic data needs a vocabulary of at least 2 tokens");
}

int32_t SyntheticData::successor(int32_t tok) const {
  return static_cast<int32_t>(Philox::u32(seed_, kTableStream, static_cast<uint64_t>(tok)) % static_cast<uint64_t>(vocab_));
}

std::string SyntheticData::describe() const {
  return "synthetic token stream (V=" + std::to_string(vocab_) + ", loss floor " + std::to_string(entropy_floor()) + " nats)";
}

void SyntheticData::fill(const Tensor& tokens, const Tensor& targets, int64_t first_sample, Split split) const {
  if (split == Split::Validation) first_sample += kValidationOffset;
  const int64_t B = tokens.dim(0), T = tokens.dim(1);
  if (T != seq_len_ || targets.shape() != tokens.shape())
    throw ShapeError("synthetic data: batch " + tokens.shape().str() + " does not match seq_len " + std::to_string(seq_len_));
  int32_t* tk = tokens.data<int32_t>();
  int32_t* tg = targets.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t sample = static_cast<uint64_t>(first_sample + b);
    const uint64_t stream = kDataStream ^ (sample * 0x9E3779B97F4A7C15ull);
    int32_t cur = static_cast<int32_t>(Philox::u32(seed_, stream, 0) % static_cast<uint64_t>(vocab_));
    for (int64_t t = 0; t <= T; ++t) {
      if (t < T) tk[b * T + t] = cur;
      if (t > 0) tg[b * T + t - 1] = cur;
      auto r = Philox::block(seed_, stream, static_cast<uint64_t>(t + 1));
      cur = (r[0] & 7u) != 0 ? successor(cur) : static_cast<int32_t>(r[1] % static_cast<uint64_t>(vocab_));
    }
  }
}

double SyntheticData::entropy_floor() const {
  const double p_jump = 1.0 / 8.0, V = static_cast<double>(vocab_);
  const double p_succ = 1.0 - p_jump + p_jump / V, p_other = p_jump / V;
  return -(p_succ * std::log(p_succ) + (V - 1) * p_other * std::log(p_other));
}

}  // namespace loom::train
