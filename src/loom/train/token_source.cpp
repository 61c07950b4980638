#include "loom/train/token_source.h"

#include "loom/error.h"
#include "loom/train/run_config.h"
#include "loom/train/shard_loader.h"
#include "loom/train/synthetic_data.h"

namespace loom::train {

std::unique_ptr<TokenSource> make_token_source(const RunConfig& cfg) {
  if (cfg.data.source == "synthetic")
    return std::make_unique<SyntheticData>(cfg.train.seed, cfg.model.resolved.vocab_size, cfg.seq_len());
  if (cfg.data.source == "shards") {
    auto loader = std::make_unique<ShardLoader>(cfg.data.dir, cfg.seq_len(), cfg.train.seed);
    // The embedding and LM head are sized by model.vocab_size; tokens from another vocabulary would
    // index past them (larger) or leave rows no token uses (smaller).
    if (loader->vocab_size() != cfg.model.resolved.vocab_size)
      throw ConfigError("model.vocab_size = " + std::to_string(cfg.model.resolved.vocab_size) + " but the shards in '" +
                        cfg.data.dir + "' use a tokenizer of " + std::to_string(loader->vocab_size()) +
                        " tokens: set model.vocab_size = " + std::to_string(loader->vocab_size()) +
                        " or prepare with --vocab-size " + std::to_string(cfg.model.resolved.vocab_size));
    if (cfg.train.eval_every > 0 && loader->windows(Split::Validation) == 0)
      loader->window(Split::Validation, 0);  // throws the error that names the fix
    return loader;
  }
  throw ConfigError("data.source = '" + cfg.data.source + "' is not known (valid: \"synthetic\", \"shards\")");
}

}  // namespace loom::train
