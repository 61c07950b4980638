// What training (model::Transformer) and generation (model::Generator) share: the model's weights bound
// by their Hugging Face names from this rank's ParameterStore, and one transformer block's forward data
// flow. The two differ only in how a block attends (the whole micro-batch, or one new token against a
// KV cache), which an AttentionStep supplies; the linears run through the kernels::LayerOps op
// interface either way.
#pragma once

#include <vector>

#include "loom/kernels/backend.h"
#include "loom/kernels/layer_ops.h"
#include "loom/model/activations.h"
#include "loom/model/moe_layer.h"
#include "loom/model/parameter_store.h"
#include "loom/spec/transformer_config.h"

namespace loom::model {

using LinearViews = kernels::LinearWeights;
struct NormViews {
  Tensor w, dw, b, db;  // b/db empty for RMSNorm
};
struct BlockWeights {
  NormViews norm1, norm2;
  LinearViews qkv, out, up, down;  // q|k|v and gate|up each one fused GEMM
  MoeWeights moe;                  // a mixture-of-experts block's MLP (then up and down are undefined)
};

// fp8 (model/fp8_recipe.h), declared here because the block's forward quantises through it.
enum class Fp8Linear;
class Fp8Recipe;
struct ModelWeights {
  Tensor wte, dwte, wpe, dwpe;  // wpe: GPT-2's learned positions
  NormViews norm_f;
  LinearViews head;             // the embedding's rows when tied
  std::vector<BlockWeights> blocks;
};

// This shard's widths: query heads, KV heads, MLP width and vocabulary rows (padded) per tp rank.
struct LocalWidths {
  int64_t heads = 0, kv_heads = 0, d_ff = 0, vocab = 0;
  int kv_shared_by = 1;  // tp ranks holding each KV head alike (tp / n_kv_heads when fewer than tp)
};
LocalWidths local_widths(const spec::TransformerConfig& cfg, const spec::ParamTable& table);

// Every weight and gradient view by name; GEMMs read the store's compute copies (bf16 in bf16 mode).
ModelWeights bind_weights(const spec::TransformerConfig& cfg, const ParameterStore& params, const LocalWidths& local);

// RoPE cos / sin tables [max_seq, head_dim / 2] (Llama), as Activations.
struct RopeTables {
  Tensor cos, sin;
};
RopeTables make_rope_tables(const spec::TransformerConfig& cfg, Allocator& alloc);

// How a block attends. qkv [N, (H + 2 KV) D] holds this block's projections (rotary not yet applied);
// the step applies the rotary embedding where the model uses it and writes att [N, H D] (and, when it
// keeps them for backward, the softmax statistics lse).
class AttentionStep {
 public:
  virtual ~AttentionStep() = default;
  virtual void forward(const Tensor& att, const Tensor& lse, const Tensor& qkv) = 0;
};

// One block's forward: x_out = x_mid + mlp(norm2(x_mid)), x_mid = x_in + attention(norm1(x_in)), saving
// what backward reads in `a`; and the norms both passes use.
class BlockRunner {
 public:
  BlockRunner(const spec::TransformerConfig& cfg, kernels::Backend& backend, kernels::LayerOps& ops, bool lowp);

  // `layer`: the block's global index (which fp8 scaling state its GEMM inputs use). A mixture-of-
  // experts block adds its routing to `moe_load` (nullptr: not counted).
  void forward(const BlockWeights& w, BlockActivations& a, const Tensor& x_in, const Tensor& x_out,
               AttentionStep& attention, int64_t layer = -1, MoeLoad* moe_load = nullptr,
               MoeScratch* moe_scratch = nullptr);
  void norm_forward(const NormViews& n, const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x);
  void norm_backward(const NormViews& n, const Tensor& dx, const Tensor& dout, const Tensor& x, const Tensor& mean,
                     const Tensor& rstd);
  // In bf16 mode writes the bf16 copy GEMMs read (in fp32 mode the copy is the tensor itself).
  void to_gemm_input(const Tensor& lp, const Tensor& f32);
  // The same for the input of block `layer`'s linear `k`: quantised under fp8 (set_fp8), else as above.
  void to_gemm_input(const Tensor& lp, const Tensor& f32, int64_t layer, Fp8Linear k);
  // precision = "fp8": the blocks' linears quantise their inputs and weights under this recipe.
  void set_fp8(Fp8Recipe* fp8) { fp8_ = fp8; }
  Fp8Recipe* fp8() const { return fp8_; }
  // The weights block `layer`'s GEMMs read: quantised under fp8, else `w` itself.
  BlockWeights gemm_weights(int64_t layer, const BlockWeights& w) const;
  MoeLayer& moe() { return moe_; }
  const MoeLayer& moe() const { return moe_; }

 private:
  const spec::TransformerConfig& cfg_;
  kernels::Backend& be_;
  kernels::LayerOps& ops_;
  bool llama_, lowp_;
  Fp8Recipe* fp8_ = nullptr;
  MoeLayer moe_;
};

}  // namespace loom::model
