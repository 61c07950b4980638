#include "loom/train/shard_loader.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include "loom/core/checksum.h"
#include "loom/core/philox.h"
#include "loom/error.h"
#include "loom/train/tokenizer.h"

namespace loom::train {

namespace fs = std::filesystem;

uint64_t keyed_permutation(uint64_t index, uint64_t n, uint64_t seed, uint64_t stream) {
  if (n <= 1) return 0;
  // Domain 2^bits with bits even and 2^bits >= n, so the walk below takes < 4
  // rounds on average.
  int bits = std::max(2, static_cast<int>(std::bit_width(n - 1)));
  bits += bits & 1;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  // Six rounds: enough for the order to look random to a training run (it is no
  // cipher).
  auto feistel = [&](uint64_t x) {
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 6; ++round) {
      const uint64_t f = Philox::u32(seed, stream, (round << 32) | r);
      const uint64_t next_r = l ^ (f & mask);
      l = r;
      r = next_r;
    }
    return (l << half) | r;
  };
  // Cycle walking: a bijection of [0, 2^bits) restricted to [0, n) by
  // re-applying it until the value lands in range stays a bijection of [0, n).
  uint64_t x = index;
  do x = feistel(x);
  while (x >= n);
  return x;
}

namespace {

uint64_t order_stream(Split split, int64_t epoch) {
  const uint64_t base = stream_of(split == Split::Train ? "loom.data.order.train" : "loom.data.order.validation");
  return base ^ (static_cast<uint64_t>(epoch) * 0x9E3779B97F4A7C15ull);
}

}  // namespace

ShardLoader::ShardLoader(const fs::path& dir, int64_t seq_len, uint64_t seed)
    : dir_(dir), set_(read_shard_set(dir)), seq_len_(seq_len), seed_(seed) {
  if (seq_len < 1) throw ConfigError("seq_len must be positive (got " + std::to_string(seq_len) + ")");
  const fs::path tok_path = dir / set_.tokenizer_file;
  // Loading (not only hashing) the tokenizer proves the file is a model and
  // gives its vocabulary.
  const Tokenizer tok = Tokenizer::load(tok_path);
  if (tok.hash() != set_.tokenizer_hash)
    throw IoError("tokenizer '" + tok_path.string() + "' has hash " + tok.hash_hex() + " but " +
                  (dir / kShardSetManifest).string() + " says " + checksum_hex(set_.tokenizer_hash) +
                  ": the tokenizer was replaced after the shards were made; re-run `loom prepare`");
  if (tok.vocab_size() != set_.vocab_size)
    throw IoError("tokenizer '" + tok_path.string() + "' has " + std::to_string(tok.vocab_size()) +
                  " tokens but the manifest says " + std::to_string(set_.vocab_size) + ": re-run `loom prepare`");
  for (const auto& e : set_.shards) {
    ShardExpectation expect{set_.tokenizer_hash, static_cast<uint32_t>(set_.vocab_size), e.split};
    MappedShard shard = MappedShard::open(dir / e.file, expect);
    if (shard.size() != e.tokens || shard.header().checksum != e.checksum)
      throw IoError("shard '" + (dir / e.file).string() + "' holds " + std::to_string(shard.size()) +
                    " tokens (checksum " + checksum_hex(shard.header().checksum) + ") but the manifest lists " +
                    std::to_string(e.tokens) + " (checksum " + checksum_hex(e.checksum) +
                    "): it comes from another run of `loom prepare`; re-run it");
    Stream& s = e.split == Split::Train ? train_ : validation_;
    // Window k of a shard covers tokens [k T, k T + T]: T inputs and, shifted
    // by one, T targets.
    const int64_t n = (shard.size() - 1) / seq_len_;
    s.first_window.push_back(s.windows);
    s.windows += n;
    s.shards.push_back(std::move(shard));
  }
  if (train_.windows == 0)
    throw ConfigError(
        fmt::format("the train split of '{}' holds {} tokens, too few for one window of seq_len + 1 = {} tokens: lower "
                    "train.seq_len or prepare a larger corpus",
                    dir.string(), set_.train_tokens, seq_len_ + 1));
}

ShardLoader::Window ShardLoader::window(Split split, int64_t index) const {
  const Stream& s = stream(split);
  if (s.windows == 0)
    throw ConfigError(
        fmt::format("the {} split of '{}' holds {} tokens, too few for one window of seq_len + 1 = {} tokens: prepare "
                    "with a larger --val-fraction, lower train.seq_len, or set train.eval_every = 0",
                    split_name(split), dir_.string(),
                    split == Split::Train ? set_.train_tokens : set_.validation_tokens, seq_len_ + 1));
  if (index < 0) throw ShapeError("global sample index must be >= 0 (got " + std::to_string(index) + ")");
  Window w;
  w.epoch = index / s.windows;
  const auto n = static_cast<uint64_t>(s.windows);
  w.id = static_cast<int64_t>(
      keyed_permutation(static_cast<uint64_t>(index % s.windows), n, seed_, order_stream(split, w.epoch)));
  const auto it = std::upper_bound(s.first_window.begin(), s.first_window.end(), w.id);
  w.shard = static_cast<int>(it - s.first_window.begin()) - 1;
  w.offset = (w.id - s.first_window[static_cast<size_t>(w.shard)]) * seq_len_;
  return w;
}

void ShardLoader::sample(Split split, int64_t index, std::span<int32_t> out) const {
  if (static_cast<int64_t>(out.size()) != seq_len_ + 1)
    throw ShapeError(fmt::format("a sample holds seq_len + 1 = {} tokens, not {}", seq_len_ + 1, out.size()));
  const Window w = window(split, index);
  stream(split).shards[static_cast<size_t>(w.shard)].copy(w.offset, out);
}

void ShardLoader::fill(const Tensor& tokens, const Tensor& targets, int64_t first_sample, Split split) const {
  if (tokens.shape().rank() != 2 || targets.shape() != tokens.shape() || tokens.dim(1) != seq_len_)
    throw ShapeError("shard loader: batch " + tokens.shape().str() + " / " + targets.shape().str() +
                     " does not match [B, seq_len = " + std::to_string(seq_len_) + "]");
  const int64_t B = tokens.dim(0), T = seq_len_;
  int32_t* tk = tokens.data<int32_t>();
  int32_t* tg = targets.data<int32_t>();
  std::vector<int32_t> buf(static_cast<size_t>(T + 1));
  for (int64_t b = 0; b < B; ++b) {
    sample(split, first_sample + b, buf);
    std::copy(buf.begin(), buf.end() - 1, tk + b * T);
    std::copy(buf.begin() + 1, buf.end(), tg + b * T);
  }
}

std::string ShardLoader::describe() const {
  return fmt::format(
      "shards '{}': train {} tokens / {} windows, validation {} tokens / {} windows of {}+1 | V={} | tokenizer {}",
      dir_.string(), set_.train_tokens, train_.windows, set_.validation_tokens, validation_.windows, seq_len_,
      set_.vocab_size, checksum_hex(set_.tokenizer_hash));
}

std::string ShardLoader::tokenizer_file() const { return (dir_ / set_.tokenizer_file).string(); }
std::string ShardLoader::tokenizer_hash() const { return checksum_hex(set_.tokenizer_hash); }

std::string ShardLoader::identity() const {
  std::string shards;
  for (const auto& e : set_.shards)
    shards += fmt::format("{}:{}:{}:{};", e.file, split_name(e.split), e.tokens, checksum_hex(e.checksum));
  return fmt::format("shards: tokenizer {}, {} shards ({})", checksum_hex(set_.tokenizer_hash), set_.shards.size(),
                     checksum_hex(checksum64(shards.data(), shards.size())));
}

}  // namespace loom::train
