// The decoder-only transformer (GPT-2 or Llama style, from the spec's config) with explicit
// forward and backward passes over a per-micro-batch ActivationContext. The model knows nothing of
// communication: it reads weights by name from the ParameterStore (this rank's shard of them, with local
// head counts and widths), runs its linears, embedding and loss through a kernels::LayerOps (the whole
// model, or a tensor-parallel shard) and everything else on the Backend.
#pragma once

#include <initializer_list>
#include <memory>
#include <vector>

#include "loom/kernels/attention_ops.h"
#include "loom/kernels/backend.h"
#include "loom/kernels/layer_ops.h"
#include "loom/model/activations.h"
#include "loom/model/block.h"
#include "loom/model/layer_hooks.h"
#include "loom/model/parameter_store.h"
#include "loom/spec/transformer_config.h"

namespace loom::model {

class Transformer {
 public:
  // ops: how the linears, embedding and loss run (nullptr: on the whole model, locally); its group size
  // must be the tensor-parallel degree the parameter table was built for. Not owned. recompute: what
  // the contexts this model makes keep for backward (spec/recompute.h). attention: where the attention
  // core runs (nullptr: over the whole sequence here); with a context-parallel group every context,
  // tokens and targets tensor holds this rank's T tokens of each sample (spec::context_positions).
  Transformer(spec::TransformerConfig cfg, ParameterStore& params, kernels::Backend& backend,
              kernels::LayerOps* ops = nullptr, spec::Recompute recompute = spec::Recompute::None,
              kernels::AttentionOps* attention = nullptr, kernels::ExpertExchange* experts = nullptr);

  const spec::TransformerConfig& config() const { return cfg_; }
  // This shard's widths: query heads, KV heads, MLP width and vocabulary rows (padded) per rank.
  const LocalWidths& local() const { return local_; }
  // A pipeline chunk: blocks [first, last), with the embeddings first (the first chunk) and the final
  // norm, head and loss last (the last chunk); either may hold no block. The whole model is
  // {0, n_layers, true, true}.
  struct Chunk {
    int64_t first = 0, last = 0;
    bool embeddings = false, head = false;
  };
  // Allocates a context for micro-batches of shape [B, T] (T x cp <= max_seq; T this rank's tokens of
  // each sample under context parallelism): for the whole model, or for
  // one chunk (its blocks' saved tensors, its part of the residual stream, the logits when it has the head).
  ActivationContext make_context(int64_t B, int64_t T) const;
  // split_backward: also keep each block's linear output gradients for backward_chunk_input /
  // backward_chunk_weight (zero-bubble schedules; not with recompute, whose weight pass would read
  // GEMM inputs no longer kept).
  ActivationContext make_context(int64_t B, int64_t T, const Chunk& chunk, bool split_backward = false) const;

  // Forward over tokens/targets (I32 [B, T], copied into the context; targets < 0 are ignored).
  // Returns the mean loss over valid targets. With grad_scale > 0 the context keeps
  // dlogits = d(loss_sum * grad_scale)/dlogits for backward(); grad_scale = 0 is evaluation only.
  double forward(ActivationContext& ctx, const Tensor& tokens, const Tensor& targets, float grad_scale);
  // Accumulates parameter gradients (+=) into the ParameterStore's gradient arena.
  void backward(ActivationContext& ctx);
  // One pipeline chunk (this rank's shard must hold it). Forward: a chunk without the embeddings reads
  // its input from ctx.residual[first] (the previous chunk's output, put there by the caller) and leaves
  // its output in ctx.residual[last]; tokens are read only by the chunk with the embeddings, targets only
  // by the one with the head, which returns the mean loss (others 0). Backward: a chunk without the head
  // reads d(loss)/d(its output) from ctx.d_res and leaves d(loss)/d(its input) there.
  double forward_chunk(ActivationContext& ctx, const Chunk& chunk, const Tensor* tokens, const Tensor* targets,
                       float grad_scale);
  void backward_chunk(ActivationContext& ctx, const Chunk& chunk);
  // backward_chunk in two passes (zero-bubble schedules; the context made with split_backward): the input
  // pass leaves d(loss)/d(input) in ctx.d_res as backward_chunk does and computes the norms' and the
  // embeddings' gradients; the weight pass adds the linears' weight and bias gradients. Together they add
  // what backward_chunk adds. Needs LayerOps::splits_backward().
  void backward_chunk_input(ActivationContext& ctx, const Chunk& chunk);
  void backward_chunk_weight(ActivationContext& ctx, const Chunk& chunk);
  // Mixture of experts: each block's routing over the training forwards since the last reset (entries of
  // dense blocks and of blocks outside this rank's shard stay empty).
  const std::vector<MoeLoad>& moe_load() const { return moe_load_; }
  void reset_moe_load();
  // Called around every unit's use in forward and backward (nullptr: none). Not owned.
  void set_hooks(LayerHooks* hooks) { hooks_ = hooks; }
  // precision = "fp8": the blocks' linears quantise under `fp8` (owned by the caller; before any
  // make_context, which then sizes the quantised output gradient's buffer).
  void set_fp8(Fp8Recipe* fp8) { runner_.set_fp8(fp8); }

 private:
  // backward_chunk (split false) or its input-gradient pass (split true): one walk over the chunk.
  void backward_walk(ActivationContext& ctx, const Chunk& chunk, bool split);
  // split: the block's linears compute only their input gradients and leave their output gradients in
  // `split` (for block_backward_weight); nullptr: whole.
  void block_backward(int64_t layer, const BlockWeights& w, BlockActivations& a, ActivationContext& ctx, const Tensor& x_in,
                      const kernels::AttentionShape& s, BlockOutputGrads* split = nullptr);
  void block_backward_weight(const BlockWeights& w, const BlockActivations& a, const BlockOutputGrads& g);
  // Under recompute: refills what block l's backward reads and the context did not keep.
  void recompute_block(int64_t l, ActivationContext& ctx, const kernels::AttentionShape& s);
  // Under sequence parallelism a norm sees only this rank's rows, so its weight gradient is a partial
  // sum: partial_grads points it at slot `slot` of the context's norm_grads scratch (zeroed by the
  // caller), add_partial_grads sums the scratch over the group and adds it to the norms' gradients.
  // Without SP the first returns `n` itself and the second does nothing.
  NormViews partial_grads(const NormViews& n, ActivationContext& c, int slot) const;
  void add_partial_grads(std::initializer_list<const NormViews*> norms, ActivationContext& c);
  kernels::AttentionShape attention_shape(int64_t B, int64_t T) const;
  // Context parallelism: the embedding's learned position rows at this context's positions, and their
  // gradient added back at those rows.
  const Tensor* position_rows(ActivationContext& c) const;
  void add_position_grads(ActivationContext& c);
  void check_chunk(const Chunk& chunk) const;  // throws unless this rank's shard holds it

  spec::TransformerConfig cfg_;
  ParameterStore& params_;
  std::unique_ptr<kernels::LayerOps> own_ops_;  // when none was given
  kernels::LayerOps* ops_;
  std::unique_ptr<kernels::AttentionOps> own_attention_;  // when none was given
  kernels::AttentionOps* attention_;
  LocalWidths local_;
  LayerHooks* hooks_ = nullptr;
  kernels::Backend& backend_;
  spec::Recompute recompute_;
  bool llama_;
  bool lowp_;
  ModelWeights w_;
  RopeTables rope_;  // Llama only
  BlockRunner runner_;
  std::vector<MoeLoad> moe_load_;
};

}  // namespace loom::model
