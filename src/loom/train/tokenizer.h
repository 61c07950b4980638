// The tokenizer: a sentencepiece BPE model, trained from text or loaded from
// its file. Its identity is the hash of the model bytes, which every shard (and
// checkpoint) records so data made with another tokenizer is refused instead of
// silently read as different tokens.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace loom::train {

struct TokenizerTrainOptions {
  int vocab_size = 8192;
  int threads = 2;
  // Sentencepiece keeps at most this many lines (a uniform sample) in memory
  // while training.
  int64_t max_sentences = 2'000'000;
  uint64_t seed = 1234;
};

class Tokenizer {
 public:
  // Trains a byte-fallback BPE model on the lines `next_line` yields (it
  // returns false at the end). Identity normalisation and kept whitespace make
  // decode(encode(text)) == text for any valid UTF-8; a newline or any byte
  // unseen in training becomes a byte token. Throws ConfigError when the text
  // cannot support the vocabulary (with the size that would work when known).
  static Tokenizer train(const std::function<bool(std::string&)>& next_line, const TokenizerTrainOptions& options);
  // Loads a model file written by save() or by sentencepiece's spm_train.
  // Throws IoError.
  static Tokenizer load(const std::filesystem::path& file);
  // `origin` names the bytes in errors.
  static Tokenizer from_bytes(std::string model_bytes, const std::string& origin);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Writes the model bytes (through a temporary file and a rename). Throws
  // IoError.
  void save(const std::filesystem::path& file) const;

  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const;
  // End of document: prepare puts one after every document, so a model learns
  // where texts end.
  int32_t eos_id() const;
  // checksum64 of the model bytes, as 16 hex digits in manifests.
  uint64_t hash() const { return hash_; }
  std::string hash_hex() const;
  const std::string& model_bytes() const { return bytes_; }

 private:
  Tokenizer(std::string bytes, const std::string& origin);
  std::string bytes_;
  uint64_t hash_ = 0;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

}  // namespace loom::train
