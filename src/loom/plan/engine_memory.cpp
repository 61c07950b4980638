#include "loom/plan/engine_memory.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "loom/error.h"
#include "loom/spec/param_table.h"
#include "loom/spec/pipeline_schedule.h"
#include "loom/spec/pipeline_stages.h"
#include "loom/spec/shard_plan.h"

namespace loom::plan {

namespace {

using spec::ArenaRange;

// A ZeRO unit as the engine cuts it (spec::ShardPlan), with what the model reads of it in f32.
struct Unit {
  ArenaRange range, rank0;                   // the unit and dp rank 0's piece of it
  int64_t f32_read = 0, f32_read_owned = 0;  // elements the model reads in f32 (all, and rank 0's)
  int64_t size() const { return range.size(); }
  int64_t owned() const { return rank0.size(); }
};

// ZeRO's units, per sharding: one over the replicas, and under expert parallelism a second for the
// routed experts over the ranks holding the same experts (spec::zero_shard_plans).
std::vector<std::vector<Unit>> units_of(spec::ParamTable table, int64_t n_layers, int dp, int ep) {
  table.shard_flat_along(spec::MeshAxis::DP);  // as the engine's ZeRO strategy does
  std::vector<spec::ShardPlan> plans;
  if (ep > 1) {
    auto both = spec::zero_shard_plans(table, n_layers, dp, dp / ep);
    plans = {std::move(both.rest), std::move(both.experts)};
  } else {
    plans = {spec::zero_shard_plan(table, n_layers, dp)};
  }
  auto f32_in = [&](const ArenaRange& r) {
    int64_t n = 0;
    for (const auto& p : table.params())
      if (!p.gemm_only) n += std::max<int64_t>(0, std::min(p.offset + p.numel(), r.end) - std::max(p.offset, r.begin));
    return n;
  };
  std::vector<std::vector<Unit>> parts;
  for (const auto& plan : plans) {
    auto& units = parts.emplace_back();
    for (size_t u = 0; u < plan.units(); ++u) {
      Unit x{plan.unit(u), plan.piece(u, 0)};
      x.f32_read = f32_in(x.range), x.f32_read_owned = f32_in(x.rank0);
      units.push_back(x);
    }
  }
  return parts;
}

// Which of the model's pieces a rank's activations cover: its chunks' blocks, the embeddings, the head.
struct RankPart {
  int64_t blocks = 0;  // blocks over all of its chunks
  bool embeddings = true, head = true;
};

// The widths of rank 0's tensor-parallel shard at micro-batch [B, T].
struct Widths {
  double N, C, D, H, KV, F, V, QKV, HPRE, R;
  double E = 0, K = 0, Fe = 0, Fs = 0;  // mixture of experts: experts, top_k, expert and shared widths
  double EP = 1;                        // expert parallelism over EP ranks
  double MX = 0;                        // the expert side's rows (spec::MoeConfig::expert_side_rows)
  double TP = 1;                        // tensor parallelism: experts split by width, every token on every rank
  bool SP = false;
  Widths(const spec::TransformerConfig& c, const spec::ParamTable& table, int64_t B, int64_t T, int tp, bool sp) {
    N = static_cast<double>(B * T), C = static_cast<double>(c.d_model), D = static_cast<double>(c.head_dim());
    H = static_cast<double>(c.n_heads / tp);
    KV = static_cast<double>(spec::kv_heads_per_rank(c, tp));
    F = static_cast<double>(c.d_ff / tp);
    const bool llama = c.arch == spec::Arch::Llama;
    // This shard's vocabulary rows (padded), from whichever of the embedding and the head it holds (a
    // middle pipeline stage holds neither and has no logits).
    V = 0;
    for (const char* name : {spec::token_embedding_name(c.arch), "lm_head.weight"})
      if (table.index_of(name)) V = static_cast<double>(table.at(name).shape[0]);
    QKV = (H + 2.0 * KV) * D;
    HPRE = llama ? 2 * F : F;
    R = sp ? N / tp : N;  // residual-stream rows on this rank
    TP = tp, SP = sp;
    if (c.moe.enabled()) {
      E = static_cast<double>(c.moe.experts), K = static_cast<double>(c.moe.top_k);
      Fe = static_cast<double>(c.expert_width() / tp), Fs = static_cast<double>(c.moe.shared_experts) * Fe;
    }
  }
};

// How many of a chunk's blocks (first .. first + blocks) are mixture-of-experts blocks.
int64_t moe_blocks_in(const spec::TransformerConfig& c, int64_t first, int64_t blocks) {
  int64_t n = 0;
  for (int64_t l = first; l < first + blocks; ++l) n += c.is_moe_layer(l);
  return n;
}

// What a mixture-of-experts block saves (model::make_moe_activations, for all N k pairs), and the
// backward scratch a context holds when its chunk has one (model::make_moe_scratch).
double moe_block_bytes(const Widths& w, bool bf16) {
  const double N = w.N, M = w.N * w.K, Mx = w.MX, lp = bf16 ? 2 : 0;
  return 4 * N * w.E + 4 * N * w.K * 3 + 4 * M  // scores; expert, weight, row; token_of_row
         + (bf16 ? 2 : 4) * M * w.C                 // the experts' inputs in GEMM precision
         + (w.EP > 1 ? (bf16 ? 2 : 4) * Mx * w.C : 0)  // and as this rank's experts run them
         + 4 * Mx * 3 * w.Fe + lp * Mx * w.Fe       // h_pre (gate|up), h_act (and its bf16 copy)
         + 4 * M * w.C                              // outputs
         + (w.Fs > 0 ? 4 * N * 3 * w.Fs + lp * N * w.Fs : 0);  // the shared experts' pre, act (bf16 copy)
}
double moe_scratch_bytes(const Widths& w, bool bf16) {
  const double N = w.N, M = w.N * w.K, Mx = w.MX;
  const double exchange = w.EP > 1 ? ((bf16 ? 2 : 4) + 4 + 4) * Mx * w.C : 0;  // received inputs, rows by source and by expert
  // Tensor parallelism: the partial sums [N, C]; under SP the gathered inputs (f32, bf16) and dout.
  const double width_split = w.TP > 1 ? 4 * N * w.C + (w.SP ? (4 + (bf16 ? 2 : 0) + 4) * N * w.C : 0) : 0;
  return 4 * (2 * M * w.C + 3 * Mx * w.Fe + N * w.K + N * w.E + 3 * N * w.Fs) + exchange + width_split;
}

// One activation context as model::Transformer::make_context allocates it for a chunk of `blocks`
// blocks, `moe` of them mixture-of-experts blocks (with the head or not).
double context_bytes(const Widths& w, int64_t blocks, int64_t moe, bool head, bool sp, bool bf16, bool split_backward,
                     Recompute recompute) {
  const double N = w.N, C = w.C, H = w.H, D = w.D, F = w.F, R = w.R;
  const double lp = bf16 ? 2 : 0;        // bf16 copies of GEMM inputs
  const double norm_out = bf16 ? 0 : 4;  // f32 norm / activation outputs (bf16: one scratch)
  const double core = 4 * N * (H + H * D) + lp * N * H * D;  // the attention core's lse, att (and att_lp)
  const double dense_mlp = 4 * N * w.HPRE + (norm_out + lp) * N * F;  // h_pre, h_act (and h_act_lp)
  // A mixture-of-experts block keeps its experts' tensors instead, and norm2's f32 output in bf16 too.
  const double moe_mlp = moe_block_bytes(w, bf16) + (bf16 ? 4 * R * C : 0);
  const double attention = 4 * R * (2 + C + 2) + 4 * N * w.QKV  // norm stats, x_mid; qkv
                           + norm_out * 2 * R * C                // n1_out, n2_out
                           + lp * 2 * R * C                      // n1_lp, n2_lp
                           + core;
  const double dense_n = static_cast<double>(blocks - moe), moe_n = static_cast<double>(moe);
  // A split (zero-bubble) backward keeps each block's four linear output gradients until its weight pass.
  const double split = split_backward ? 4 * (2 * R * C + N * (w.HPRE + w.QKV)) : 0;
  const double n = static_cast<double>(blocks);
  // Recompute: what the blocks do not keep is one set the chunk's blocks share (model::Transformer); under
  // full recompute that set holds a dense and an MoE MLP's tensors when the chunk has both kinds.
  double total = n * (attention + split) + dense_n * dense_mlp + moe_n * moe_mlp;
  if (blocks > 0 && recompute == Recompute::Selective) total -= n * core - core;
  if (blocks > 0 && recompute == Recompute::Full)
    total = attention + (dense_n > 0 ? dense_mlp : 0) + (moe_n > 0 ? moe_mlp : 0) + 4 * R * C;  // and its output
  total += 4 * R * C * static_cast<double>(blocks + 1);  // residual stream, the chunk's input to its output
  if (bf16) total += 4 * std::max(R * C, N * F);         // the shared f32 scratch
  if (head) {
    total += 4 * R * 2 + norm_out * R * C + lp * R * C;  // final norm
    total += 4 * N * w.V + 4 * N;                        // logits (dlogits), losses
  }
  total += 4 * (2 * R * C + N * (H * D + w.QKV + F + w.HPRE));  // backward scratch
  if (moe > 0) total += moe_scratch_bytes(w, bf16);
  total += 4 * N * 2;                                           // the context's tokens + targets
  if (sp) total += 4 * 4 * C;                                   // partial norm gradients
  return total;
}

// What a context adds under context parallelism (model::Transformer::make_context): the rotary tables'
// rows at its tokens' positions (Llama), or the learned positions' rows and their gradient (GPT-2, in
// the chunk with the embeddings).
double cp_context_bytes(const spec::TransformerConfig& c, const Widths& w, double T_local, bool embeddings,
                        double wpe_bytes) {
  if (c.arch == spec::Arch::Llama) return 4 * T_local * w.D;
  return embeddings ? (wpe_bytes + 4) * T_local * w.C : 0;
}

// parallel::ContextParallelAttention's scratch, every slot at its largest (it reserves them so): per
// micro-batch of B samples of T_local tokens on this rank.
double cp_attention_bytes(const Widths& w, double B, double T_local, bool all_to_all) {
  const double HD = w.H * w.D, KD2 = 2 * w.KV * w.D, c = T_local / 2, N = B * T_local;
  if (all_to_all) return 4 * (2 * N * std::max(HD + KD2, 2 * HD) + 2 * N * HD + 2 * N * HD + N * (HD + KD2));
  // Ring: K/V double buffer, dK/dV double buffer and one block's dK/dV; the head K/V rows; the queries, one
  // block's output (its dQ in backward), the other blocks' summed dQ; the tail queries; one block's
  // statistics; the tail's dO and O.
  return 4 * (5 * N * KD2 + B * c * KD2 + 3 * N * HD + B * c * HD + B * w.H * T_local + 2 * B * c * HD);
}

// What a rank holds once beside its contexts: the trainer's token and target buffers, RoPE tables and,
// under tensor parallelism, the scratch of parallel::TensorParallelOps (each slot sized by its largest
// use and allocated by the first: the embedding's, the blocks', the loss's).
double rank_activation_bytes(const spec::TransformerConfig& c, const Widths& w, const RankPart& part, int tp, bool sp,
                             bool bf16) {
  const double N = w.N, C = w.C, R = w.R;
  double total = 4 * N * 2;  // the trainer's tokens + targets
  if (c.arch == spec::Arch::Llama) total += 4.0 * static_cast<double>(c.max_seq) * w.D;  // RoPE cos + sin tables
  if (tp > 1) {
    const bool blocks = part.blocks > 0;
    if (blocks || part.embeddings) total += 4 * N * C;  // partial products of row-parallel linears (and the embedding)
    if (part.embeddings) total += 4 * N;                 // local tokens
    if (part.head) total += 12 * N + 12 * N * tp;        // cross-entropy partials, gathered
    if (blocks && c.n_kv_heads < tp) {                   // shared KV rows: saved gradient, gathered over the group
      const double shared = 2 * w.KV * w.D * C;
      total += 4 * shared * (1 + tp);
    }
    if (sp && blocks) {
      total += (bf16 ? 2 : 4) * N * C;  // all-gathered input of a column-parallel linear
      total += 4 * N * C + 4 * N * C;   // all-gathered output gradient; input gradient before reduce-scatter
    }
    if (sp && (blocks || part.embeddings)) total += 4 * R * C;  // reduce-scattered rows of a row-parallel output
  }
  return total;
}

}  // namespace

spec::PipelineSchedule engine_schedule(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return spec::PipelineSchedule::GPipe;
    case Schedule::OneFOneB: return spec::PipelineSchedule::OneFOneB;
    case Schedule::Interleaved: return spec::PipelineSchedule::Interleaved1F1B;
    case Schedule::ZeroBubble: return spec::PipelineSchedule::ZeroBubbleH1;
  }
  return spec::PipelineSchedule::OneFOneB;
}

Schedule planner_schedule(spec::PipelineSchedule s) {
  for (Schedule p : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved, Schedule::ZeroBubble})
    if (engine_schedule(p) == s) return p;
  return Schedule::OneFOneB;
}

EngineMemory loom_engine_memory(const spec::TransformerConfig& cfg, const Layout& l, int64_t seq, EngineNumerics numerics,
                                const EnginePipeline& pipe, int pipeline_rank) {
  const bool bf16 = numerics.bf16, only = numerics.bf16_only;
  if (l.ep != 1 && (!cfg.moe.enabled() || cfg.moe.experts % l.ep != 0 || l.dp % l.ep != 0))
    throw ConfigError("Loom's engine runs expert parallelism over ep ranks dividing dp and a mixture of experts' "
                      "experts, not " + l.str());
  if (cfg.moe.enabled() && (l.cp > 1 || l.schedule == Schedule::ZeroBubble))
    throw ConfigError("Loom's engine runs mixture-of-experts blocks without cp or zb-h1, not " + l.str());
  if (seq % (2 * l.cp) != 0)
    throw ConfigError("context parallelism at cp = " + std::to_string(l.cp) + " needs the sequence (" +
                      std::to_string(seq) + ") to split into 2 x cp chunks");
  // Rank 0's shard: under tp every rank holds the same amount, padding of the vocabulary aside (rank 0
  // holds whole rows and, with fewer KV heads than tp, the same one-head piece as every rank); under pp
  // the first stage's chunks, with the embeddings.
  spec::TableShard shard{0, l.tp};
  shard.ep_size = l.ep;  // rank 0 holds the first experts / ep of every MoE block
  std::optional<spec::PipelineStages> stages;
  if (l.pp > 1) {
    if (l.zero >= 2 && l.dp > 1)
      throw ConfigError("Loom's engine runs pipeline parallelism with ZeRO 0 or 1, not " + l.str());
    if (l.schedule == Schedule::ZeroBubble && l.tp > 1)
      throw ConfigError("Loom's engine runs the zero-bubble schedule at tp = 1, not " + l.str());
    if (l.schedule == Schedule::ZeroBubble && l.recompute != Recompute::None)
      throw ConfigError("Loom's engine runs the zero-bubble schedule without recompute, not " + l.str());
    stages = spec::cut_pipeline(cfg, seq, l.pp, l.vpp, pipe.layers);
    if (pipeline_rank < 0 || pipeline_rank >= l.pp)
      throw ConfigError("pipeline rank " + std::to_string(pipeline_rank) + " is not one of pp = " + std::to_string(l.pp));
    const spec::TableShard stage = stages->shard_of(pipeline_rank);
    shard = stage, shard.tp_rank = 0, shard.tp_size = l.tp, shard.ep_size = l.ep;
  }
  const auto table = spec::build_param_table(cfg, shard);
  // ZeRO shards over the replicas: every rank holding the same weights, dp x cp of them.
  const int dp = l.dp * l.cp, stage = dp > 1 ? l.zero : 0;  // alone, every stage is the plain run
  const auto parts = units_of(table, cfg.n_layers, dp, l.ep);
  const double total = static_cast<double>(table.total_numel());
  const double weight_bytes = only ? 2 : 4 + (bf16 ? 2 : 0);  // f32 master (+ bf16 copy), or bf16 alone

  // What a gathered unit adds on rank 0 (the other ranks' elements), for weights and for gradients.
  auto gathered_weights = [&](const Unit& u) {
    const double others = static_cast<double>(u.size() - u.owned());
    if (!bf16) return others * 4;
    if (only) return others * 2;  // every kernel reads the bf16 weights: nothing travels in f32
    return others * 2 + static_cast<double>(u.f32_read - u.f32_read_owned) * 4;  // bf16 copies + exact f32
  };
  auto gathered_grads = [&](const Unit& u) { return static_cast<double>(u.size() - u.owned()) * 4; };

  EngineMemory m;
  // Each sharding (one engine each) on its own: ZeRO-3 holds the embeddings and head for the whole
  // micro-batch and two blocks at a time (one in use, the next prefetched). ZeRO-1/2 in bf16 keep the
  // bf16 copies whole and, of the f32 masters, this rank's pieces and every element read in f32.
  // ZeRO-2/3 keep the embedding gradient for all of backward, and two other units' scratch: the one in
  // backward and the one whose reduction is still landing (the head's at first). An engine keeps what
  // one unit gives back for the next (its page pool, or two slots), so per engine the largest two units
  // count, whichever blocks they are: exact for alike blocks, an upper bound where dense and MoE blocks
  // alternate (ZeRO-2 fp32, dp 4 x ep 2, every = 2: gradients 15% over).
  double owned = 0, f32_kept = 0, zero3_weights = 0, zero_grads = 0;
  for (const auto& units : parts) {
    const Unit &embed = units.front(), &head = units.back();
    double largest_block = 0, largest_block_grads = 0, part_owned = 0;
    for (size_t i = 1; i + 1 < units.size(); ++i) {
      largest_block = std::max(largest_block, gathered_weights(units[i]));
      largest_block_grads = std::max(largest_block_grads, gathered_grads(units[i]));
    }
    for (const auto& u : units) {
      part_owned += static_cast<double>(u.owned());
      f32_kept += static_cast<double>(u.owned() + u.f32_read - u.f32_read_owned);
    }
    owned += part_owned;
    zero3_weights += part_owned * weight_bytes + gathered_weights(embed) + gathered_weights(head) + 2 * largest_block;
    zero_grads += part_owned * 4 + gathered_grads(embed) +
                  std::max(gathered_grads(head) + largest_block_grads, 2 * largest_block_grads);
  }
  if (stage == 3)
    m.parameters = zero3_weights;
  else if (stage >= 1 && bf16 && !only)
    m.parameters = total * 2 + f32_kept * 4;
  else
    m.parameters = total * weight_bytes;
  m.gradients = stage >= 2 ? zero_grads : total * 4;
  m.optimizer = (stage >= 1 ? owned : total) * (only ? 4 : 8);  // AdamW m and v in f32 (bf16-pure: bf16)
  const bool sp = l.sp && l.tp > 1;
  // Each rank's contexts hold its seq / cp tokens of every sample.
  const int64_t T_local = seq / l.cp;
  Widths w(cfg, table, l.micro_batch, T_local, l.tp, sp);
  w.EP = l.ep;
  w.MX = static_cast<double>(cfg.moe.expert_side_rows(l.micro_batch * T_local, l.ep));
  const double B = static_cast<double>(l.micro_batch), Tl = static_cast<double>(T_local);
  // Under cp: the trainer's whole samples (loaded before this rank's tokens are taken) and the attention's
  // scratch, once per rank.
  const double cp_rank_bytes =
      l.cp > 1 ? 4 * B * static_cast<double>(seq) * 2 + cp_attention_bytes(w, B, Tl, l.cp_all_to_all) : 0;
  auto cp_context = [&](bool embeddings) {
    return l.cp > 1 ? cp_context_bytes(cfg, w, Tl, embeddings, only ? 2 : 4) : 0;
  };
  if (!stages) {
    m.activations = context_bytes(w, cfg.n_layers, cfg.moe_layer_count(), true, sp, bf16, false, l.recompute) +
                    cp_context(true) +
                    rank_activation_bytes(cfg, w, RankPart{cfg.n_layers, true, true}, l.tp, sp, bf16) + cp_rank_bytes;
    return m;
  }
  // The executor keeps one context per micro-batch it holds at once on each chunk, training or validating.
  const auto plan = spec::build_pipeline_schedule(engine_schedule(l.schedule), l.pp, l.vpp,
                                                  static_cast<int>(pipe.micro_batches));
  const auto training = spec::contexts_held(plan, pipeline_rank),
             validating = spec::contexts_held(plan, pipeline_rank, true);
  RankPart part{0, pipeline_rank == 0, false};
  for (int c = 0; c < l.vpp; ++c) {
    const int g = plan.global_chunk(pipeline_rank, c);
    const int64_t blocks = stages->layers[static_cast<size_t>(g)];
    int64_t first = 0;
    for (int i = 0; i < g; ++i) first += stages->layers[static_cast<size_t>(i)];
    const bool head = g == stages->chunks() - 1;
    part.blocks += blocks, part.head = part.head || head;
    const int n = std::max(training[static_cast<size_t>(c)], validating[static_cast<size_t>(c)]);
    m.activations += n * (context_bytes(w, blocks, moe_blocks_in(cfg, first, blocks), head, sp, bf16,
                                        l.schedule == Schedule::ZeroBubble, l.recompute) +
                          cp_context(g == 0));
  }
  m.activations += rank_activation_bytes(cfg, w, part, l.tp, sp, bf16) + cp_rank_bytes;
  if (bf16 && pipe.bf16_transfers) m.activations += 2 * 2 * w.R * w.C;  // the executor's bf16 wire buffers
  return m;
}

}  // namespace loom::plan
