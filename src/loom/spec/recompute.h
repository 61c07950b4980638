// Activation recompute: what a block keeps from its forward pass for backward, and what backward
// computes again instead. The engine (model::Transformer) runs it and the planner prices it, from this
// one description.
//   none       every block keeps all it saves (model/activations.h);
//   selective  the attention core's output and softmax statistics are not kept: backward runs the
//              attention forward again from the block's saved (rotated) q, k and v;
//   full       a block keeps only its input (the residual stream): backward runs the whole block
//              forward again, into one block's worth of scratch, before its backward.
#pragma once

#include <string>
#include <string_view>

namespace loom::spec {

enum class Recompute { None, Selective, Full };

std::string_view recompute_name(Recompute r);  // "none", "selective", "full"
// Throws ConfigError naming `key` and the valid names.
Recompute parse_recompute(std::string_view name, std::string_view key = "train.recompute");

}  // namespace loom::spec
