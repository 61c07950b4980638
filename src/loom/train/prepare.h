// `loom prepare` as a library call: text files -> documents -> (trained or
// given) tokenizer -> train / validation split by document -> token shards +
// manifest in one folder. Never prints: progress goes to a callback, so the CLI
// decides how to show it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "loom/train/corpus.h"
#include "loom/train/shard_set.h"

namespace loom::train {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or folders
  std::filesystem::path out_dir;
  int vocab_size = 8192;                    // used when training a tokenizer
  std::string tokenizer;                    // reuse this model file instead of training one
  double val_fraction = 0.02;               // share of documents held out for validation
  uint64_t seed = 1234;                     // the split (and the tokenizer's sentence sample)
  int64_t shard_tokens = int64_t{1} << 26;  // a shard closes after the document that reaches this
  int threads = 2;
  // Replace a shard set already in out_dir. Without it that is refused: checkpoints trained on the old
  // set need its tokenizer, and a re-run used to replace it without a word.
  bool overwrite = false;
};

struct PrepareProgress {
  enum class Phase { Scan, TokenizerRead, TokenizerTrain, Encode, Done };
  Phase phase = Phase::Scan;
  uint64_t bytes_done = 0,
           bytes_total = 0;  // of the current pass over the corpus
  int64_t documents = 0;     // seen so far in this pass
  int64_t tokens = 0;        // written so far (Encode, Done)
  int64_t shards = 0;
  const CorpusFiles* files = nullptr;  // the files found (set from the end of Scan on)
};

struct PrepareResult {
  ShardSet set;
  CorpusFiles files;
  double tokenizer_seconds = 0;  // training or loading
  double seconds = 0;
};

// Throws ConfigError for impossible options (vocab, fraction, a corpus too
// small to split) and IoError for unreadable inputs or an --out folder holding
// foreign files.
PrepareResult prepare_corpus(const PrepareOptions& options,
                             const std::function<void(const PrepareProgress&)>& on_progress = {});

}  // namespace loom::train
