#include "loom/train/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <unordered_map>

#include "loom/core/checksum.h"
#include "loom/core/file_writer.h"
#include "loom/error.h"
#include "loom/train/corpus.h"

namespace loom::train {

namespace {

// 256 byte pieces (byte_fallback) + <unk>, <s>, </s>: the smallest vocabulary
// that can spell anything.
constexpr int kMinVocab = 256 + 3 + 1;

// Feeds sentencepiece's trainer from a callback, skipping empty lines (they
// teach nothing).
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::function<bool(std::string&)>& next) : next_(next) { advance(); }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    do {
      if (!next_(line_)) {
        done_ = true;
        return;
      }
    } while (line_.empty());
  }
  const std::function<bool(std::string&)>& next_;
  std::string line_;
  bool done_ = false;
};

}  // namespace

Tokenizer::Tokenizer(std::string bytes, const std::string& origin)
    : bytes_(std::move(bytes)),
      hash_(checksum64(bytes_.data(), bytes_.size())),
      sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  if (bytes_.empty()) throw IoError("tokenizer '" + origin + "' is empty: re-run `loom prepare` to write it again");
  auto st = sp_->LoadFromSerializedProto(bytes_);
  if (!st.ok())
    throw IoError("tokenizer '" + origin + "' is not a sentencepiece model (" + st.ToString() +
                  "): pass the tokenizer.model that `loom prepare` wrote");
}

Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::train(const std::function<bool(std::string&)>& next_line, const TokenizerTrainOptions& o) {
  if (o.vocab_size < kMinVocab || o.vocab_size > (1 << 24))
    throw ConfigError("vocabulary size " + std::to_string(o.vocab_size) +
                      " is out of range: a byte-fallback BPE needs at least " + std::to_string(kMinVocab) +
                      " (256 bytes + specials + 1 merge)");
  // Identity normalisation and kept whitespace: the tokens spell the text
  // exactly, so generated text round-trips and the loss is measured on the
  // corpus as written. Digits split one by one so numbers do not eat the
  // vocabulary.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"split_digits", "true"},
      {"character_coverage", "0.9995"},
      {"input_sentence_size", std::to_string(o.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", "16384"},
      {"num_threads", std::to_string(std::max(1, o.threads))},
      {"minloglevel", "2"},  // sentencepiece logs to stderr; library code must not print
  };
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(o.seed));
  LineIterator lines(next_line);
  if (lines.done()) throw ConfigError("cannot train a tokenizer on an empty corpus: the inputs hold no text");
  std::string proto;
  auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &proto);
  if (!st.ok()) {
    // The two ways a vocabulary size fails: fewer ids than the byte pieces,
    // specials and the corpus's distinct characters need, or more than the
    // corpus has pairs to merge.
    const std::string msg = st.ToString();
    const bool too_small = msg.find("smaller than required_chars") != std::string::npos;
    throw ConfigError(
        "training the tokenizer (BPE, vocab " + std::to_string(o.vocab_size) + ") failed: " + msg + " -- " +
        (too_small ? "raise --vocab-size: 259 ids go to bytes and specials, plus one per distinct character"
                   : "a small corpus supports only a small vocabulary: lower --vocab-size"));
  }
  return Tokenizer(std::move(proto), "<trained>");
}

Tokenizer Tokenizer::load(const std::filesystem::path& file) { return Tokenizer(read_file(file), file.string()); }

Tokenizer Tokenizer::from_bytes(std::string model_bytes, const std::string& origin) {
  return Tokenizer(std::move(model_bytes), origin);
}

void Tokenizer::save(const std::filesystem::path& file) const { write_file_atomically(file.string(), bytes_); }

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  auto st = sp_->Encode(text, &ids);
  if (!st.ok()) throw IoError("tokenizer failed to encode text: " + st.ToString());
  return {ids.begin(), ids.end()};
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::vector<int> v(ids.begin(), ids.end());
  const int n = sp_->GetPieceSize();
  for (int id : v)
    if (id < 0 || id >= n)
      throw ConfigError("token id " + std::to_string(id) + " is outside the tokenizer's vocabulary [0, " +
                        std::to_string(n) + ")");
  std::string out;
  auto st = sp_->Decode(v, &out);
  if (!st.ok()) throw IoError("tokenizer failed to decode: " + st.ToString());
  return out;
}

int32_t Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int32_t Tokenizer::eos_id() const { return sp_->eos_id(); }
std::string Tokenizer::hash_hex() const { return checksum_hex(hash_); }

}  // namespace loom::train
