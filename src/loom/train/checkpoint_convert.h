// `loom ckpt convert --to-layout`: rewrites a checkpoint of any layout as the sharded checkpoint another
// layout would have saved (each of its ranks' pieces in their own files), offline and one rank's pieces
// in memory at a time. Loading already reshards on the fly; this is for moving a checkpoint to a cluster
// of another shape ahead of time, and for checking that a layout can hold the model.
#pragma once

#include <cstdint>
#include <string>

namespace loom::train {

struct TargetLayout {
  int64_t dp = 1, tp = 1, pp = 1, zero = 0;
};

// Parses "dp=4,tp=2,pp=1,zero=1" (any subset, comma- or space-separated; the rest 1 / 0). Throws
// ConfigError naming the bad item.
TargetLayout parse_target_layout(const std::string& text);

// Writes <out>/step-N (and <out>/latest) from the checkpoint at `src`; refuses, before writing, a layout
// the model cannot take (the same errors as training) and an `out` that already holds checkpoints.
// Returns the new checkpoint's folder.
std::string convert_checkpoint_layout(const std::string& src, const std::string& out, const TargetLayout& to);

}  // namespace loom::train
