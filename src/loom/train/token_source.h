// Where training tokens come from: the synthetic stream or a prepared corpus. A source serves
// (B, T) token / target windows whose content is a pure function of (seed, epoch, global sample
// index) -- never of the rank or the micro-batching -- so a run's data is the same under any layout
// and a resumed run needs no loader state beyond the step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "loom/core/tensor.h"

namespace loom::train {

struct RunConfig;

enum class Split { Train, Validation };

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Fills tokens and targets (I32 [B, T]) with samples first_sample .. first_sample + B - 1 of `split`;
  // targets are the tokens shifted by one (each sample is a window of T + 1 tokens).
  virtual void fill(const Tensor& tokens, const Tensor& targets, int64_t first_sample, Split split) const = 0;
  // One line for start-up logs.
  virtual std::string describe() const = 0;
  // The tokenizer model file the tokens were made with, and its hash ("" for synthetic data):
  // checkpoints carry it and refuse to resume on data made with another tokenizer.
  virtual std::string tokenizer_file() const { return ""; }
  virtual std::string tokenizer_hash() const { return ""; }
  // What the tokens are, as every rank of a job must see it: the tokenizer and the set of shards with
  // their checksums (the content, not the folder's path), or "synthetic".
  virtual std::string identity() const = 0;
  // Samples in one pass over `split`, or 0 for a source without end (synthetic data).
  virtual int64_t samples(Split) const { return 0; }
};

// Builds the source the config names (data.source). Throws ConfigError / IoError naming the fix.
std::unique_ptr<TokenSource> make_token_source(const RunConfig& cfg);

}  // namespace loom::train
