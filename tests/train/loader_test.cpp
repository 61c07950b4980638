// The shard loader: windows are slices of the shards, their order a pure
// function of (seed, epoch, global sample index) -- the same under any
// micro-batching -- every window visited once per epoch, and a shard set that
// does not match its tokenizer or the model is refused.
#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "data_test_util.h"
#include "loom/core/checksum.h"
#include "loom/error.h"
#include "loom/train/run_config.h"
#include "loom/train/shard_loader.h"
#include "loom/train/tokenizer.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;

Tokenizer small_tokenizer(uint64_t seed, int vocab) {
  test::TextGen g(seed);
  int n = 0;
  return Tokenizer::train([&](std::string& l) { return n++ < 2000 ? (l = g.sentence(), true) : false; },
                          {.vocab_size = vocab, .threads = 1});
}

class LoaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = std::make_unique<Tokenizer>(small_tokenizer(test::fresh_seed(), kVocab)); }
  static void TearDownTestSuite() { tok_.reset(); }

  void SetUp() override {
    test::log_seed();
    dir_ = test::scratch_dir("loader");
    std::mt19937_64 rng(test::fresh_seed());
    T_ = 8 + static_cast<int64_t>(rng() % 9);
    tok_->save(dir_ / "tokenizer.model");
    ShardSet set;
    set.tokenizer_hash = tok_->hash();
    set.vocab_size = kVocab;
    set.eos_id = tok_->eos_id();
    set.seed = 1;
    set.val_fraction = 0.1;
    auto add = [&](const std::string& name, Split split, size_t n) {
      std::vector<int32_t> t(n);
      for (auto& x : t) x = static_cast<int32_t>(rng() % kVocab);
      ShardHeader h;
      h.tokenizer_hash = tok_->hash();
      h.vocab_size = kVocab;
      h.split = split;
      h = write_shard(dir_ / name, h, t);
      set.shards.push_back({name, split, static_cast<int64_t>(n), 1, h.checksum});
      (split == Split::Train ? set.train_tokens : set.validation_tokens) += static_cast<int64_t>(n);
      (split == Split::Train ? train_ : val_).push_back(std::move(t));
    };
    for (int i = 0; i < 3; ++i) add("train-0000" + std::to_string(i) + ".bin", Split::Train, 200 + rng() % 400);
    add("validation-00000.bin", Split::Validation, 100 + rng() % 100);
    write_shard_set(dir_, set);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Samples [first, first + B) through fill(), as the trainer reads them.
  std::pair<std::vector<int32_t>, std::vector<int32_t>> fill(const ShardLoader& l, int64_t first, int64_t B,
                                                             Split split = Split::Train) {
    std::vector<int32_t> tk(static_cast<size_t>(B * T_)), tg(tk.size());
    l.fill(Tensor::wrap(tk.data(), {B, T_}, DType::I32), Tensor::wrap(tg.data(), {B, T_}, DType::I32), first, split);
    return {tk, tg};
  }

  static constexpr int kVocab = 400;
  static inline std::unique_ptr<Tokenizer> tok_;
  fs::path dir_;
  int64_t T_ = 0;
  std::vector<std::vector<int32_t>> train_, val_;
};

TEST_F(LoaderTest, WindowsAreShardSlicesAndTargetsAreTheNextTokens) {
  ShardLoader l(dir_, T_, test::fresh_seed());
  int64_t expect_windows = 0;
  for (auto& s : train_) expect_windows += (static_cast<int64_t>(s.size()) - 1) / T_;
  ASSERT_EQ(l.windows(Split::Train), expect_windows);
  auto [tk, tg] = fill(l, 0, 6);
  for (int64_t b = 0; b < 6; ++b) {
    const auto w = l.window(Split::Train, b);
    const auto& src = train_[static_cast<size_t>(w.shard)];
    ASSERT_LE(w.offset + T_ + 1, static_cast<int64_t>(src.size()));
    for (int64_t t = 0; t < T_; ++t) {
      EXPECT_EQ(tk[static_cast<size_t>(b * T_ + t)], src[static_cast<size_t>(w.offset + t)]);
      EXPECT_EQ(tg[static_cast<size_t>(b * T_ + t)], src[static_cast<size_t>(w.offset + t + 1)]);
    }
  }
}

TEST_F(LoaderTest, SameGlobalSamplesWhateverTheMicroBatchSplit) {
  ShardLoader l(dir_, T_, test::fresh_seed());
  const int64_t first = static_cast<int64_t>(test::fresh_seed() % 1000);
  auto whole = fill(l, first, 4);
  std::vector<int32_t> halves, quarters;
  for (int64_t m = 0; m < 2; ++m) {
    auto part = fill(l, first + 2 * m, 2).first;
    halves.insert(halves.end(), part.begin(), part.end());
  }
  for (int64_t m = 0; m < 4; ++m) {
    auto part = fill(l, first + m, 1).first;
    quarters.insert(quarters.end(), part.begin(), part.end());
  }
  EXPECT_EQ(halves, whole.first);
  EXPECT_EQ(quarters, whole.first);
  // A second loader over the same files (another rank, a resumed run) serves
  // the same samples.
  ShardLoader other(dir_, T_, test::fresh_seed());
  EXPECT_EQ(fill(other, first, 4), whole);
}

TEST_F(LoaderTest, EveryWindowIsVisitedOncePerEpoch) {
  ShardLoader l(dir_, T_, test::fresh_seed());
  const int64_t n = l.windows(Split::Train);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<int64_t> seen;
    for (int64_t i = 0; i < n; ++i) {
      const auto w = l.window(Split::Train, epoch * n + i);
      EXPECT_EQ(w.epoch, epoch);
      seen.insert(w.id);
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), n) << "epoch " << epoch;
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), n - 1);
  }
}

TEST_F(LoaderTest, EachEpochAndEachSeedHasItsOwnOrder) {
  ShardLoader a(dir_, T_, test::fresh_seed()), b(dir_, T_, test::fresh_seed() + 1);
  const int64_t n = a.windows(Split::Train);
  ASSERT_GT(n, 20);
  std::vector<int64_t> order_a, order_b, order_a1;
  for (int64_t i = 0; i < n; ++i) {
    order_a.push_back(a.window(Split::Train, i).id);
    order_b.push_back(b.window(Split::Train, i).id);
    order_a1.push_back(a.window(Split::Train, n + i).id);
  }
  EXPECT_NE(order_a, order_b);
  EXPECT_NE(order_a, order_a1);
  std::vector<int64_t> identity(static_cast<size_t>(n));
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(order_a, identity);
}

TEST_F(LoaderTest, ValidationSamplesComeFromValidationShards) {
  ShardLoader l(dir_, T_, test::fresh_seed());
  const auto& src = val_[0];
  ASSERT_GT(l.windows(Split::Validation), 0);
  auto [tk, tg] = fill(l, 0, 3, Split::Validation);
  for (int64_t b = 0; b < 3; ++b) {
    const auto w = l.window(Split::Validation, b);
    EXPECT_EQ(w.shard, 0);
    for (int64_t t = 0; t < T_; ++t)
      EXPECT_EQ(tk[static_cast<size_t>(b * T_ + t)], src[static_cast<size_t>(w.offset + t)]);
  }
}

TEST_F(LoaderTest, KeyedPermutationIsABijectionForAnySize) {
  std::mt19937_64 rng(test::fresh_seed());
  for (uint64_t n :
       {uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{5}, uint64_t{64}, uint64_t{65}, 1 + rng() % 3000}) {
    std::vector<bool> hit(n, false);
    const uint64_t seed = rng();
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t p = keyed_permutation(i, n, seed, 7);
      ASSERT_LT(p, n);
      EXPECT_FALSE(hit[p]) << "n=" << n << " i=" << i;
      hit[p] = true;
    }
  }
}

TEST_F(LoaderTest, ReplacedTokenizerIsRefused) {
  small_tokenizer(test::fresh_seed() + 99, kVocab).save(dir_ / "tokenizer.model");
  try {
    ShardLoader l(dir_, T_, 1);
    FAIL() << "expected an IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.model"), std::string::npos) << e.what();
  }
}

TEST_F(LoaderTest, ShardReplacedByOneFromAnotherPrepareIsRefused) {
  ShardHeader h;
  h.tokenizer_hash = tok_->hash();
  h.vocab_size = kVocab;
  std::vector<int32_t> t(train_[1].size(), 3);
  write_shard(dir_ / "train-00001.bin", h, t);
  EXPECT_THROW(ShardLoader(dir_, T_, 1), IoError);
}

TEST_F(LoaderTest, MissingManifestIsRefusedNamingPrepare) {
  fs::remove(dir_ / kShardSetManifest);
  try {
    ShardLoader l(dir_, T_, 1);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("loom prepare"), std::string::npos) << e.what();
  }
}

TEST_F(LoaderTest, SequenceLongerThanTheValidationSplitIsRefusedWhenValidating) {
  ShardLoader l(dir_, 250,
                1);  // longer than the validation shard (< 200 tokens)
  EXPECT_EQ(l.windows(Split::Validation), 0);
  EXPECT_THROW(l.window(Split::Validation, 0), ConfigError);
}

TEST_F(LoaderTest, TrainerRefusesAModelVocabularyOtherThanTheTokenizers) {
  auto cfg = parse_run_config("", "<test>",
                              {"model.preset=\"tiny\"", "data.source=\"shards\"", "data.dir=\"" + dir_.string() + "\"",
                               "train.seq_len=" + std::to_string(T_)});
  try {
    make_token_source(cfg);
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("512"), std::string::npos) << what;
    EXPECT_NE(what.find("400"), std::string::npos) << what;
  }
  cfg.model.resolved.vocab_size = kVocab;
  auto src = make_token_source(cfg);
  EXPECT_EQ(src->tokenizer_hash(), checksum_hex(tok_->hash()));
  EXPECT_NE(src->describe().find("shards"), std::string::npos);
}

}  // namespace
}  // namespace loom::train
