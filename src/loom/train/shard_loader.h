// The training data of a prepared corpus: memory-maps a shard set (see
// shard_set.h) and serves (B, T + 1) windows. Global sample g of a split reads
// window perm_{seed, split, epoch}(g mod N), epoch = g / N, where N is the
// split's number of windows and perm a keyed bijection of [0, N): the order is
// a pure function of (seed, epoch, global sample index), so it is the same
// whatever the ranks or the micro-batching, and a resumed run needs only the
// step. Rule in docs/data.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/train/shard_format.h"
#include "loom/train/shard_set.h"
#include "loom/train/token_source.h"

namespace loom::train {

class ShardLoader final : public TokenSource {
 public:
  // Reads dir/manifest.json, loads the tokenizer it names, and maps and
  // validates every shard against it (magic, version, checksums, tokenizer
  // hash, vocabulary, split). Throws IoError naming the file and the fix;
  // ConfigError when the train split has no window of seq_len + 1.
  ShardLoader(const std::filesystem::path& dir, int64_t seq_len, uint64_t seed);

  void fill(const Tensor& tokens, const Tensor& targets, int64_t first_sample, Split split) const override;
  std::string describe() const override;
  std::string tokenizer_file() const override;
  std::string tokenizer_hash() const override;
  std::string identity() const override;

  int64_t vocab_size() const { return set_.vocab_size; }
  int64_t seq_len() const { return seq_len_; }
  // Windows of seq_len + 1 tokens in one epoch of `split` (consecutive windows
  // share one token).
  int64_t windows(Split split) const { return stream(split).windows; }
  int64_t samples(Split split) const override { return windows(split); }

  // Where global sample `index` of `split` starts: shard number and token
  // offset in it.
  struct Window {
    int64_t epoch = 0;
    int64_t id = 0;  // the window's rank in [0, windows(split)), before
                     // permutation: stable across seeds
    int shard = 0;   // index into the split's shards
    int64_t offset = 0;
  };
  Window window(Split split, int64_t index) const;
  // Copies the seq_len + 1 tokens of global sample `index`.
  void sample(Split split, int64_t index, std::span<int32_t> out) const;

  const ShardSet& shard_set() const { return set_; }

 private:
  struct Stream {
    std::vector<MappedShard> shards;
    std::vector<int64_t> first_window;  // prefix sums of windows per shard
    int64_t windows = 0;
  };
  const Stream& stream(Split s) const { return s == Split::Train ? train_ : validation_; }

  std::filesystem::path dir_;
  ShardSet set_;
  int64_t seq_len_;
  uint64_t seed_;
  Stream train_, validation_;
};

// A keyed bijection of [0, n): a balanced Feistel network over the next even
// power of two with Philox as the round function, cycle-walking back into
// range. Exposed for tests and docs.
uint64_t keyed_permutation(uint64_t index, uint64_t n, uint64_t seed, uint64_t stream);

}  // namespace loom::train
