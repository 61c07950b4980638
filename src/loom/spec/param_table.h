// The parameter table: every trainable tensor of a model as {name, shape, initialiser, placement,
// weight decay}, derived from a TransformerConfig. Parameters, gradients and optimizer state each
// live in one arena laid out by this table, so bucketing, sharding and checkpoints are slicing.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/spec/placement.h"
#include "loom/spec/transformer_config.h"

namespace loom::spec {

struct Init {
  enum class Kind { Normal, Zeros, Ones };
  Kind kind = Kind::Normal;
  float std = 0.02f;
};

// A half-open range of arena elements (a ZeRO shard's piece, a unit, a bucket).
struct ArenaRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const ArenaRange&) const = default;
};

// Which shard of the model a table describes: this rank's coordinate along the tensor-parallel axis,
// and, under pipeline parallelism, which of the model's pieces it holds. The default is the whole model.
struct TableShard {
  int tp_rank = 0, tp_size = 1;
  // Pipeline: the blocks this rank holds, as ascending [begin, end) ranges (empty: every block); whether
  // it holds the embeddings (the first chunk) and the final norm + head (the last chunk: with tied
  // embeddings it then holds the token embedding too, as the head's weight).
  std::vector<std::pair<int64_t, int64_t>> blocks;
  bool embeddings = true, head = true;
  // Expert parallelism: this rank's place among the ep ranks that split each MoE block's experts (it
  // holds experts [ep_rank, ep_rank + 1) x experts / ep_size; the router and the rest whole).
  int ep_rank = 0, ep_size = 1;
  // Every tensor whole (not split by tp); a pipeline shard's tensors are whole, only fewer.
  bool whole() const { return tp_size == 1; }
  bool every_layer() const { return blocks.empty() && embeddings && head; }
  bool holds_block(int64_t b) const;
  bool operator==(const TableShard&) const = default;
};

struct ParamSpec {
  std::string name;             // Hugging Face-compatible, e.g. "transformer.h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;   // this shard's shape; matrices are [out_features, in_features], as torch.nn.Linear
  std::vector<int64_t> global_shape;  // the whole tensor's (equal to shape in a whole-model table)
  Init init;
  Placement placement;
  bool weight_decay = false;    // matrices (embeddings included) decay; biases and norm gains do not
  int64_t offset = 0;           // element offset in the arena
  // Read by the model only as a GEMM operand, so in bf16 mode only its bf16 copy is ever read: linear
  // weights and an untied LM head. Norm gains, biases and embeddings are read in f32.
  bool gemm_only = false;
  // A routed expert's weight: held by one ep rank of each ep group, so its gradient is reduced over the
  // ranks holding the same experts (the other ep groups), not over every replica.
  bool expert = false;

  int64_t numel() const;
};

class ParamTable {
 public:
  ParamTable() = default;
  explicit ParamTable(TableShard shard) : shard_(shard) {}
  const TableShard& shard() const { return shard_; }
  const std::vector<ParamSpec>& params() const { return params_; }
  // The element of the whole tensor that element `local` (row-major in p.shape) of this shard holds, or -1
  // for padding (a vocabulary that tp does not divide). Initialisation is keyed by it, so a parameter's
  // values are the same numbers under every layout.
  int64_t global_element(const ParamSpec& p, int64_t local) const;
  // The same for local elements [begin, end) of p, as runs whose global elements are consecutive:
  // f(local_first, global_first, length) with global_first -1 for a run of padding. What keys
  // element-wise randomness (stochastic rounding) without a lookup per element.
  void for_each_global_run(const ParamSpec& p, int64_t begin, int64_t end,
                           const std::function<void(int64_t, int64_t, int64_t)>& f) const;
  int64_t total_numel() const { return total_; }
  // Parameters excluding token and position embeddings (the LM head counts only when untied).
  int64_t non_embedding_numel() const;
  const ParamSpec& at(const std::string& name) const;  // throws ConfigError naming the tensor
  // Arena offsets where each transformer block's parameters start, plus (last entry) where the
  // parameters after the blocks start (final norm, untied head): n_layers + 1 entries. Backward makes
  // gradients final block by block from the end, so these are the gradient-readiness boundaries. A
  // block the shard does not hold starts (empty) where the next held one does.
  std::vector<int64_t> block_starts(int64_t n_layers) const;
  std::optional<size_t> index_of(const std::string& name) const;

  // `p.shape` is the whole tensor's shape; the table cuts this shard's out of it by p.placement. A
  // tensor a pipeline shard does not hold is skipped.
  void add(ParamSpec p);
  // With tied embeddings a pipeline shard holding the head holds the token embedding as its weight.
  void set_tied(bool tied) { tied_ = tied; }
  // Marks every tensor Shard(flat) along `axis` (ZeRO / FSDP along dp): shapes and offsets stay this
  // shard's, the pieces are spec::ShardPlan's.
  void shard_flat_along(MeshAxis axis);

 private:
  TableShard shard_;
  bool tied_ = false;
  std::vector<ParamSpec> params_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in params_
  int64_t total_ = 0;
};

// The arena ranges (ascending, merged) whose elements this shard counts in a sum over the whole model,
// such as the gradient norm: every global element is held by one or more tp ranks (replicated norms and
// biases by all, a shared KV piece by tp / n_kv_heads) and counted by exactly one, the first holder.
std::vector<ArenaRange> counted_ranges(const ParamTable& table);
// The elements in both lists of ascending, disjoint ranges.
std::vector<ArenaRange> intersect(const std::vector<ArenaRange>& a, const std::vector<ArenaRange>& b);

// Builds the table in the order the forward pass touches the tensors. Within a layer, q/k/v (Llama)
// and gate/up are adjacent, so one GEMM can run on their concatenation. Every tensor carries its
// Megatron-style tensor-parallel placement (column-parallel q/k/v, fc, gate/up and the vocabulary
// rows of the embedding and head: Shard(0); row-parallel projections: Shard(1); norms and the biases
// after a row-parallel GEMM: Replicate); `shard` picks one tp rank's part (local shapes), refusing with
// one line a width the tp degree does not divide.
ParamTable build_param_table(const TransformerConfig& cfg, TableShard shard = {});

// Where block `layer`'s mixture-of-experts tensors are named: "model.layers.L.block_sparse_moe." (Llama:
// Mixtral's names) or "transformer.h.L.moe." (GPT-2).
std::string moe_param_prefix(const TransformerConfig& cfg, int64_t layer);

// The routed experts [first, last) a shard holds in every MoE block.
std::pair<int64_t, int64_t> local_experts(const TransformerConfig& cfg, const TableShard& shard);
// The arena ranges of the routed experts' weights (ParamSpec::expert), ascending and merged.
std::vector<ArenaRange> expert_ranges(const ParamTable& table);
// Elements of ascending, disjoint ranges `a` that are not in `b` (ascending, disjoint).
std::vector<ArenaRange> subtract(const std::vector<ArenaRange>& a, const std::vector<ArenaRange>& b);

// Throws ConfigError naming the numbers and the valid degrees when `tp` cannot split `cfg` (heads, KV
// heads, FFN width). A vocabulary tp does not divide is padded, never refused.
void validate_tensor_parallel(const TransformerConfig& cfg, int tp);
// KV heads each tp rank holds: its n_kv_heads / tp, or, with fewer KV heads than tp, one (replicated
// over tp / n_kv_heads ranks).
inline int64_t kv_heads_per_rank(const TransformerConfig& cfg, int tp) {
  return cfg.n_kv_heads >= tp ? cfg.n_kv_heads / tp : 1;
}
// Whether tp can hold the KV heads that way: one of tp and n_kv_heads divides the other.
inline bool tp_splits_kv_heads(const TransformerConfig& cfg, int tp) {
  return cfg.n_kv_heads >= tp ? cfg.n_kv_heads % tp == 0 : tp % cfg.n_kv_heads == 0;
}

}  // namespace loom::spec
