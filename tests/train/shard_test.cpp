// The token shard format: an exact round trip, and every kind of damage refused
// with a message that names the file and says what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "data_test_util.h"
#include "loom/error.h"
#include "loom/core/checksum.h"
#include "loom/train/shard_format.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> random_tokens(uint64_t seed, size_t n, uint32_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

class ShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::log_seed();
    dir_ = test::scratch_dir("shard");
    tokens_ = random_tokens(test::fresh_seed(), 1000 + test::fresh_seed() % 1000, kVocab);
    header_.token_bytes = 2;
    header_.tokenizer_hash = 0x1234abcd5678ef01ull;
    header_.vocab_size = kVocab;
    header_.split = Split::Validation;
    header_.documents = 17;
    path_ = dir_ / "validation-00000.bin";
    write_shard(path_, header_, tokens_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Expects open() to throw an IoError whose text names the shard and contains
  // `phrase`.
  void expect_refused(const std::string& phrase, const ShardExpectation& expect = {}) {
    try {
      MappedShard::open(path_, expect);
      FAIL() << "expected the shard to be refused (" << phrase << ")";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path_.string()), std::string::npos) << what;
      EXPECT_NE(what.find(phrase), std::string::npos) << what;
    }
  }
  void patch(size_t offset, const void* bytes, size_t n) {
    std::string b = read_all(path_);
    std::memcpy(b.data() + offset, bytes, n);
    write_all(path_, b);
  }

  static constexpr uint32_t kVocab = 700;
  fs::path dir_, path_;
  std::vector<int32_t> tokens_;
  ShardHeader header_;
};

TEST_F(ShardTest, WriteThenReadGivesTheSameTokensAndHeader) {
  MappedShard s = MappedShard::open(path_, {header_.tokenizer_hash, kVocab, Split::Validation});
  ASSERT_EQ(s.size(), static_cast<int64_t>(tokens_.size()));
  EXPECT_EQ(s.header().tokenizer_hash, header_.tokenizer_hash);
  EXPECT_EQ(s.header().vocab_size, kVocab);
  EXPECT_EQ(s.header().split, Split::Validation);
  EXPECT_EQ(s.header().documents, 17u);
  EXPECT_EQ(fs::file_size(path_), kShardHeaderBytes + 2 * tokens_.size());
  std::vector<int32_t> back(tokens_.size());
  s.copy(0, back);
  EXPECT_EQ(back, tokens_);
  EXPECT_EQ(s.at(5), tokens_[5]);
}

TEST_F(ShardTest, LargeVocabulariesUseFourByteTokens) {
  const uint32_t big = 100000;
  auto toks = random_tokens(test::fresh_seed() + 1, 500, big);
  ShardHeader h = header_;
  h.vocab_size = big;
  h.token_bytes = token_bytes_for(big);
  ASSERT_EQ(h.token_bytes, 4u);
  EXPECT_EQ(token_bytes_for(65536), 2u);
  write_shard(dir_ / "big.bin", h, toks);
  MappedShard s = MappedShard::open(dir_ / "big.bin");
  std::vector<int32_t> back(toks.size());
  s.copy(0, back);
  EXPECT_EQ(back, toks);
}

TEST_F(ShardTest, MovedShardStaysReadable) {
  MappedShard a = MappedShard::open(path_);
  MappedShard b = std::move(a);
  EXPECT_EQ(b.at(0), tokens_[0]);
}

TEST_F(ShardTest, WriterRefusesTokensOutsideTheVocabulary) {
  auto bad = tokens_;
  bad[3] = kVocab;
  EXPECT_THROW(write_shard(dir_ / "bad.bin", header_, bad), ConfigError);
  EXPECT_FALSE(fs::exists(dir_ / "bad.bin"));
}

TEST_F(ShardTest, EmptyFileIsRefused) {
  write_all(path_, "");
  expect_refused("is empty");
}

TEST_F(ShardTest, FileShorterThanTheHeaderIsRefusedAsTruncated) {
  write_all(path_, read_all(path_).substr(0, 40));
  expect_refused("truncated");
}

TEST_F(ShardTest, FileMissingTokensIsRefusedAsTruncated) {
  std::string b = read_all(path_);
  write_all(path_, b.substr(0, b.size() - 1 - test::fresh_seed() % 100));
  expect_refused("truncated");
}

TEST_F(ShardTest, TrailingBytesAreRefused) {
  write_all(path_, read_all(path_) + "xy");
  expect_refused("unexpected bytes");
}

TEST_F(ShardTest, WrongMagicIsRefused) {
  patch(0, "NOTASHRD", 8);
  expect_refused("not a Loom token shard");
}

TEST_F(ShardTest, UnknownVersionIsRefused) {
  const uint32_t v = 2;
  patch(8, &v, 4);
  expect_refused("format version 2");
}

TEST_F(ShardTest, CorruptedHeaderIsRefused) {
  const uint32_t vocab = kVocab + 1;  // a plausible value: only the header checksum can tell
  patch(40, &vocab, 4);
  expect_refused("corrupted header");
}

// Found by the shard_header fuzzer: a vocabulary past int32 let a 4-byte token within it come out of
// the loader negative. A header with a valid checksum must still hold a vocabulary token ids can carry.
TEST_F(ShardTest, VocabularyPastInt32IsRefusedEvenWithAValidHeaderChecksum) {
  const uint32_t vocab = 0x80000001u;
  patch(40, &vocab, 4);
  std::string b = read_all(path_);
  const uint64_t sum = loom::checksum64(reinterpret_cast<const unsigned char*>(b.data()), 56);
  patch(56, &sum, 8);
  expect_refused("vocabulary of 2147483649 tokens");
}

TEST_F(ShardTest, WriterRefusesAVocabularyPastInt32) {
  ShardHeader h = header_;
  h.vocab_size = 0x80000000u;
  h.token_bytes = 4;
  EXPECT_THROW(write_shard(dir_ / "huge.bin", h, tokens_), ConfigError);
}

TEST_F(ShardTest, FlippedTokenByteIsRefusedByTheChecksum) {
  std::string b = read_all(path_);
  const size_t at = kShardHeaderBytes + test::fresh_seed() % (b.size() - kShardHeaderBytes);
  b[at] = static_cast<char>(b[at] ^ 0x01);
  write_all(path_, b);
  expect_refused("checksum");
}

TEST_F(ShardTest, ShardOfAnotherTokenizerIsRefused) {
  expect_refused("was made with tokenizer", {header_.tokenizer_hash ^ 1, std::nullopt, std::nullopt});
}

TEST_F(ShardTest, ShardOfAnotherVocabularyIsRefused) {
  expect_refused("vocabulary of 700", {std::nullopt, 512u, std::nullopt});
}

TEST_F(ShardTest, ShardOfTheOtherSplitIsRefused) {
  expect_refused("listed as train", {std::nullopt, std::nullopt, Split::Train});
}

TEST_F(ShardTest, MissingFileIsRefused) {
  fs::remove(path_);
  expect_refused("cannot be opened");
}

}  // namespace
}  // namespace loom::train
