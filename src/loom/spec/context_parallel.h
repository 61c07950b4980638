// Context parallelism as data: which tokens of a sample each rank of a cp group holds, how attention
// crosses the group (ring or all-to-all), and the checks a layout must pass before any rank starts.
//
// Token assignment (the same in both modes): a sample of T tokens is cut into 2 cp chunks of
// T / (2 cp); cp rank r holds chunks r and 2 cp - 1 - r (head and tail, "zigzag"). Under causal
// attention a chunk's work grows with its index, so every rank gets one cheap and one dear chunk and
// equal work. Worked example, T = 16, cp = 2 (chunks of 4): rank 0 holds positions 0-3 and 12-15,
// rank 1 holds 4-11.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/spec/transformer_config.h"

namespace loom::spec {

enum class CpMode {
  Ring,      // K/V blocks travel around the group while each block's attention runs
  AllToAll,  // Ulysses: sequence-sharded to head-sharded before attention and back after
};
const char* cp_mode_name(CpMode m);  // "ring", "all-to-all"
// Throws ConfigError naming the valid modes.
CpMode parse_cp_mode(const std::string& s);

// Global positions of the tokens cp rank `rank` holds of a T-token sample, in the order they are held
// (T / cp of them). cp = 1: 0 .. T-1.
std::vector<int32_t> context_positions(int64_t T, int cp, int rank);

// Throws ConfigError, one line naming the numbers and the fix, unless a model with these widths can run
// T-token samples at this cp degree and mode, tp ranks sharding the heads first: T must split into
// 2 cp chunks; all-to-all mode needs each tp rank's query heads and KV heads divisible by cp.
void validate_context_parallel(const TransformerConfig& cfg, int64_t T, int cp, CpMode mode, int tp = 1);

}  // namespace loom::spec
