// A prepared corpus on disk: a folder holding the tokenizer, the train and
// validation shards and a manifest.json that lists them with their token and
// document counts and records how the corpus was split (seed, fraction and the
// validation documents). `loom prepare` writes it; the loader reads it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/train/token_source.h"

namespace loom::train {

inline constexpr const char* kShardSetManifest = "manifest.json";
inline constexpr const char* kShardSetFormat = "loom-shards";
inline constexpr int kShardSetVersion = 1;

struct ShardEntry {
  std::string file;  // a name inside the folder
  Split split = Split::Train;
  int64_t tokens = 0;
  int64_t documents = 0;
  uint64_t checksum = 0;  // the shard header's token checksum
};

struct ShardSet {
  std::string tokenizer_file = "tokenizer.model";  // inside the folder
  uint64_t tokenizer_hash = 0;
  int64_t vocab_size = 0;
  int32_t eos_id = -1;
  bool tokenizer_trained = true;  // false: reused with --tokenizer
  uint64_t seed = 0;
  double val_fraction = 0;
  std::vector<std::string> inputs;
  int64_t files = 0;
  int64_t train_documents = 0, validation_documents = 0;
  int64_t train_tokens = 0, validation_tokens = 0;
  // Indices, in corpus order (files sorted, documents in file order), of the
  // validation documents.
  std::vector<int64_t> validation_document_ids;
  std::vector<ShardEntry> shards;
};

// Writes manifest.json atomically (the last file prepare writes: a folder
// without it is incomplete).
void write_shard_set(const std::filesystem::path& dir, const ShardSet& set);
// Reads and checks manifest.json. Throws IoError naming the file and the fix.
ShardSet read_shard_set(const std::filesystem::path& dir);
// The checks of read_shard_set over the manifest's text; `path` names it in errors.
ShardSet parse_shard_set(const std::string& text, const std::filesystem::path& path);

const char* split_name(Split s);

}  // namespace loom::train
