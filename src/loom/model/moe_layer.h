// A mixture-of-experts MLP ([model.moe]): the router scores each token's experts and picks top_k, the
// (token, slot) pairs are placed in expert order under the capacity (or all of them, dropless), each
// expert runs its SwiGLU on its rows, and the outputs are summed back per token with the router's
// weights; shared experts run on every token beside them. The block calls it in place of its dense MLP.
#pragma once

#include <vector>

#include "loom/kernels/backend.h"
#include "loom/kernels/expert_exchange.h"
#include "loom/kernels/layer_ops.h"
#include "loom/model/activations.h"
#include "loom/spec/transformer_config.h"

namespace loom::model {

struct MoeWeights {
  kernels::LinearWeights router;                // [E, C]
  // Per expert, the GEMMs' weights and the gradients: gate|up [2 Fe, C] (w1 | w3), down [C, Fe] (w2).
  std::vector<Tensor> gate_up, gate_up_grad, down, down_grad;
  kernels::LinearWeights shared_gate_up, shared_down;  // [2 Fs, C], [C, Fs]; undefined without shared experts
  Tensor score_bias;  // [E] auxiliary-loss-free selection bias (undefined: none)
  bool defined() const { return router.w.defined(); }
};

// One block's load over a step's micro-batches (training forwards only, not recomputes).
struct MoeLoad {
  std::vector<int64_t> routed;  // [E] (token, slot) pairs routed to each expert, before capacity
  int64_t dropped = 0;          // pairs past capacity
  int64_t pairs = 0;            // tokens x top_k
  double aux_loss = 0;          // sum over micro-batches of the load-balancing loss
  int64_t micro_batches = 0;
};

// How an MoE MLP is split over ranks: its experts over `ep` ranks (expert parallelism), every expert's
// width over `tp` ranks (tensor parallelism; with sequence parallelism the block's rows too).
struct MoeSplit {
  int ep = 1, tp = 1;
  bool sequence_parallel = false;
};

// The saved tensors of one MoE MLP over N tokens (the whole micro-batch's, under sequence parallelism
// too; expert-order buffers sized for all N k pairs; the expert side for ep x N k rows under expert
// parallelism; expert and shared widths / tp), and the scratch its context shares between blocks.
MoeActivations make_moe_activations(const spec::TransformerConfig& cfg, int64_t N, bool lowp, Allocator& alloc,
                                    MoeSplit split = {});
MoeScratch make_moe_scratch(const spec::TransformerConfig& cfg, int64_t N, bool lowp, Allocator& alloc,
                            MoeSplit split = {});

class MoeLayer {
 public:
  // ops: the tensor-parallel group's collectives (nullptr or a group of one: the whole width here).
  MoeLayer(const spec::TransformerConfig& cfg, kernels::Backend& backend, bool lowp, kernels::LayerOps* ops = nullptr);
  // Where the experts live (nullptr: all here). Under expert parallelism this rank's weights hold its
  // experts only (spec::local_experts). Not owned.
  void set_exchange(kernels::ExpertExchange* exchange) { exchange_ = exchange; }
  int ep() const { return exchange_ ? exchange_->size() : 1; }
  int tp() const { return ops_ ? ops_->size() : 1; }
  MoeSplit split() const { return {ep(), tp(), ops_ && ops_->sequence_shards() > 1}; }
  // Whether model.moe.capacity_factor drops tokens (training and evaluation), or every pair is kept
  // (generation: a prompt's routing must not depend on how many tokens are fed at once).
  void set_capacity(bool on) { capacity_ = on; }

  // out [N, C] += moe(x); x [N, C] is the normed input in GEMM precision, x_f32 the same in f32 (the
  // router's input: it runs in f32 unless its weight is bf16, under bf16-pure). `load`
  // (nullptr: not counted) gains this call's routing. Under tensor parallelism every rank routes the
  // whole micro-batch alike and runs its slice of every expert (and of the shared experts); the partial
  // outputs are summed over the group. Under sequence parallelism x, x_f32, out (and in backward dout,
  // dx) hold this rank's N / tp rows and the whole rows are gathered first.
  // `s`: the context's MoE scratch, which expert and tensor parallelism also use in forward (nullptr
  // without either).
  void forward(const MoeWeights& w, MoeActivations& a, const Tensor& x, const Tensor& x_f32, const Tensor& out,
               MoeLoad* load, MoeScratch* s = nullptr);
  // dx [N, C] = d(loss)/d(x) (written) from dout = d(loss)/d(out); the weights' gradients accumulate.
  // aux_scale: the load-balancing loss's weight in the loss.
  void backward(const MoeWeights& w, MoeActivations& a, MoeScratch& s, const Tensor& dout, const Tensor& dx,
                const Tensor& x, const Tensor& x_f32, double aux_scale);

 private:
  // This rank's experts on their rows (xe, `offsets` over its experts) into y, and back: dx from dy.
  void run_experts(const MoeWeights& w, MoeActivations& a, const std::vector<int64_t>& offsets, const Tensor& y);
  void experts_backward(const MoeWeights& w, MoeActivations& a, MoeScratch& s, const std::vector<int64_t>& offsets,
                        const Tensor& dy, const Tensor& dx);
  // The block's normed input as every rank routes it: whole rows (gathered under sequence parallelism;
  // in GEMM precision and in f32).
  std::pair<Tensor, Tensor> whole_inputs(const Tensor& x, const Tensor& x_f32, MoeScratch* s);
  // Expert parallelism: rows received source after source into expert order, and back (a gather by
  // `order`, traced as ep_reorder).
  void reorder(void* dst, const void* src, const int32_t* order, int64_t rows, int64_t bytes_per_row) const;
  // Expert parallelism: exchanges the per-expert counts and works out a's row plan (rows to and from
  // each ep rank, the local experts' offsets, the received <-> by-expert orders).
  void plan_exchange(MoeActivations& a) const;

  const spec::TransformerConfig& cfg_;
  kernels::Backend& be_;
  bool lowp_;
  bool capacity_ = true;
  kernels::LayerOps* ops_;
  kernels::ExpertExchange* exchange_ = nullptr;
};

}  // namespace loom::model
