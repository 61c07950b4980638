#include "loom/train/token_source.h"

#include "loom/error.h"
#include "loom/train/run_config.h"
#include "loom/train/synthetic_data.h"

namespace loom::train {

std::unique_ptr<TokenSource> make_token_source(const RunConfig& cfg) {
  if (cfg.data.source == "synthetic")
    return std::make_unique<SyntheticData>(cfg.train.seed, cfg.model.resolved.vocab_size, cfg.seq_len());
  throw ConfigError("data.source = '" + cfg.data.source + "' is not known (valid: \"synthetic\")");
}

}  // namespace loom::train
