// How the model's transformer blocks are cut into the pp x v chunks of a pipeline (v virtual stages per
// rank; rank r holds global chunks r, r + pp, ...). Chunk 0 also holds the embedding, the last chunk the
// final norm, the head and the loss. By default the blocks are balanced by their declared cost (the
// head's cost counts against the last chunk); an explicit list of blocks per chunk may be uneven, as real
// runs take a block or two off the first and last stages (126 layers on 16 stages).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/spec/param_table.h"
#include "loom/spec/transformer_config.h"

namespace loom::spec {

struct PipelineStages {
  int pp = 1, v = 1;
  std::vector<int64_t> layers;  // per global chunk: how many blocks it holds
  int chunks() const { return pp * v; }
  int64_t first_layer(int chunk) const;  // the chunk's first block
  int64_t blocks_on(int rank) const;     // the blocks of all of pipeline rank `rank`'s chunks
  int rank_of(int chunk) const { return chunk % pp; }
  int local_chunk(int chunk) const { return chunk / pp; }
  std::string str() const;  // "8,8,8,6"
  // The part of the model pipeline rank `rank` holds: the blocks of its chunks, the embeddings on rank 0,
  // the head on the rank of the last chunk (tp fields at their defaults).
  TableShard shard_of(int rank) const;
};

// Training cost per token (FLOPs) of one block, and of the final norm + head + loss, at sequence length
// `seq`: 6 x parameters, plus attention's 6 T C per block.
double block_cost(const TransformerConfig& cfg, int64_t seq);
double head_cost(const TransformerConfig& cfg);

// explicit_layers: blocks per global chunk (empty: balanced by cost). Throws ConfigError naming the
// numbers and a split that works when the list has the wrong length, a negative count or the wrong sum,
// or when there are fewer blocks than chunks.
PipelineStages cut_pipeline(const TransformerConfig& cfg, int64_t seq, int pp, int v,
                            const std::vector<int64_t>& explicit_layers = {});

// L blocks on K chunks as evenly as possible, the lighter chunks at the two ends (first, last, second,
// second to last, ...): how stacks cut a model whose blocks pp x v does not divide -- Llama 3 405B's 126
// on 16 stages as 7, 8 x 14, 7, where the first stage also holds the embeddings and the most
// activations in flight, and the last the head and the loss. Needs 1 <= K <= L (ConfigError).
std::vector<int64_t> trimmed_ends(int64_t L, int K);

// "7,8,8,7" -> {7, 8, 8, 7}; throws ConfigError naming `key` on anything else.
std::vector<int64_t> parse_layer_counts(const std::string& text, const std::string& key);

}  // namespace loom::spec
