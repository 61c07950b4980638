// The sentencepiece BPE tokenizer: exact round trips, stable identity (hash),
// clear refusals.
#include "loom/train/tokenizer.h"

#include <gtest/gtest.h>

#include "data_test_util.h"
#include "loom/error.h"

namespace loom::train {
namespace {

using test::TextGen;

std::vector<std::string> corpus_lines(uint64_t seed, int n) {
  TextGen g(seed);
  std::vector<std::string> lines;
  for (int i = 0; i < n; ++i) lines.push_back(g.sentence());
  return lines;
}

Tokenizer train_on(const std::vector<std::string>& lines, int vocab) {
  size_t i = 0;
  return Tokenizer::train([&](std::string& l) { return i < lines.size() ? (l = lines[i++], true) : false; },
                          {.vocab_size = vocab, .threads = 1});
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    lines_ = corpus_lines(test::fresh_seed(), 3000);
    tok_ = std::make_unique<Tokenizer>(train_on(lines_, 400));
  }
  static void TearDownTestSuite() { tok_.reset(); }
  void SetUp() override { test::log_seed(); }
  static inline std::vector<std::string> lines_;
  static inline std::unique_ptr<Tokenizer> tok_;
};

TEST_F(TokenizerTest, TrainsTheRequestedVocabulary) {
  EXPECT_EQ(tok_->vocab_size(), 400);
  EXPECT_GE(tok_->eos_id(), 0);
  EXPECT_LT(tok_->eos_id(), 400);
}

TEST_F(TokenizerTest, DecodeOfEncodeGivesTheTextBack) {
  TextGen g(test::fresh_seed() ^ 0x7e57);
  std::vector<std::string> texts = {
      "",
      "a",
      " leading space, trailing space ",
      "Two  spaces\tand a tab\nand a newline\n\nand a blank line\n",
      "Digits 0123456789 and 3.14159, punctuation: (!?) [x] {y} <z> @#$%^&*_+=~`|\\/\"'",
      "UTF-8: caf\xc3\xa9, na\xc3\xafve, \xe2\x9c\x93, \xce\xbb-calculus, \xf0\x9f\x99\x82 (unseen in training)",
  };
  for (int i = 0; i < 20; ++i) {
    std::string doc = g.document(i);
    texts.push_back(doc);
  }
  for (const auto& t : texts) {
    const auto ids = tok_->encode(t);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok_->vocab_size()) << id;
    EXPECT_EQ(tok_->decode(ids), t);
  }
}

TEST_F(TokenizerTest, CompressesTheTextItWasTrainedOn) {
  // BPE merges must have happened: far fewer tokens than bytes on
  // in-distribution text.
  size_t bytes = 0, tokens = 0;
  for (size_t i = 0; i < 200; ++i) bytes += lines_[i].size(), tokens += tok_->encode(lines_[i]).size();
  EXPECT_LT(static_cast<double>(tokens), 0.6 * static_cast<double>(bytes));
}

TEST_F(TokenizerTest, SaveThenLoadKeepsTokensAndHash) {
  auto dir = test::scratch_dir("tok-save");
  tok_->save(dir / "t.model");
  Tokenizer back = Tokenizer::load(dir / "t.model");
  EXPECT_EQ(back.hash(), tok_->hash());
  EXPECT_EQ(back.hash_hex().size(), 16u);
  EXPECT_EQ(back.vocab_size(), tok_->vocab_size());
  for (size_t i = 0; i < 50; ++i) EXPECT_EQ(back.encode(lines_[i]), tok_->encode(lines_[i]));
  std::filesystem::remove_all(dir);
}

TEST_F(TokenizerTest, SameLinesGiveTheSameModelAndOtherLinesAnother) {
  Tokenizer again = train_on(lines_, 400);
  EXPECT_EQ(again.hash(), tok_->hash());
  Tokenizer other = train_on(corpus_lines(test::fresh_seed() + 1, 3000), 400);
  EXPECT_NE(other.hash(), tok_->hash());
}

TEST_F(TokenizerTest, DecodeRefusesIdsOutsideTheVocabulary) {
  std::vector<int32_t> ids = {1, 400};
  EXPECT_THROW(tok_->decode(ids), ConfigError);
}

TEST(TokenizerErrors, VocabularyTooLargeForTheTextIsRefusedNamingTheFlag) {
  try {
    train_on({"tiny corpus", "of two lines"}, 8192);
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--vocab-size"), std::string::npos) << e.what();
  }
}

TEST(TokenizerErrors, VocabularyBelowTheByteAlphabetIsRefused) {
  EXPECT_THROW(train_on({"some text"}, 100), ConfigError);
}

TEST(TokenizerErrors, LoadingAFileThatIsNotAModelNamesTheFile) {
  auto dir = test::scratch_dir("tok-bad");
  test::write_text(dir / "garbage.model", "this is not a protobuf \x01\x02\x03");
  try {
    Tokenizer::load(dir / "garbage.model");
    FAIL() << "expected an IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("garbage.model"), std::string::npos) << e.what();
  }
  test::write_text(dir / "empty.model", "");
  EXPECT_THROW(Tokenizer::load(dir / "empty.model"), IoError);
  EXPECT_THROW(Tokenizer::load(dir / "missing.model"), IoError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace loom::train
