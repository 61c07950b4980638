#include "loom/plan/engine_memory.h"

#include <algorithm>
#include <string>
#include <vector>

#include "loom/error.h"
#include "loom/spec/param_table.h"
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

std::vector<Unit> units_of(spec::ParamTable table, int64_t n_layers, int dp) {
  table.shard_flat_along(spec::MeshAxis::DP);  // as the engine's ZeRO strategy does
  const spec::ShardPlan plan = spec::zero_shard_plan(table, n_layers, dp);
  auto f32_in = [&](const ArenaRange& r) {
    int64_t n = 0;
    for (const auto& p : table.params())
      if (!p.gemm_only) n += std::max<int64_t>(0, std::min(p.offset + p.numel(), r.end) - std::max(p.offset, r.begin));
    return n;
  };
  std::vector<Unit> units;
  for (size_t u = 0; u < plan.units(); ++u) {
    Unit x{plan.unit(u), plan.piece(u, 0)};
    x.f32_read = f32_in(x.range), x.f32_read_owned = f32_in(x.rank0);
    units.push_back(x);
  }
  return units;
}

// Activations of one micro-batch context on tp rank 0, as model::Transformer::make_context allocates
// them, plus the trainer's token and target buffers and, under tensor parallelism, the scratch of
// parallel::TensorParallelOps (each slot sized by the largest use; the sequence-parallel ones only
// with SP).
double activation_bytes(const spec::TransformerConfig& c, const spec::ParamTable& table, int64_t B, int64_t T, int tp,
                        bool sp, bool bf16) {
  const double N = static_cast<double>(B * T), C = static_cast<double>(c.d_model);
  const double D = static_cast<double>(c.head_dim());
  const double H = static_cast<double>(c.n_heads / tp);
  const double KV = static_cast<double>(c.n_kv_heads >= tp ? c.n_kv_heads / tp : 1);
  const double F = static_cast<double>(c.d_ff / tp);
  const bool llama = c.arch == spec::Arch::Llama;
  const double V = static_cast<double>(table.at(llama ? "model.embed_tokens.weight" : "transformer.wte.weight").shape[0]);
  const double QKV = (H + 2.0 * KV) * D;
  const double HPRE = llama ? 2 * F : F;
  const double R = sp ? N / tp : N;                          // residual-stream rows on this rank
  const double lp = bf16 ? 2 : 0;                            // bf16 copies of GEMM inputs
  const double norm_out = bf16 ? 0 : 4;                      // f32 norm / activation outputs (bf16: one scratch)
  double layer = 4 * R * (2 + C + 2) + 4 * N * (QKV + H + H * D + HPRE)  // norm stats, x_mid; qkv, lse, att, h_pre
                 + norm_out * (2 * R * C + N * F)                         // n1_out, n2_out, h_act
                 + lp * (2 * R * C + N * (H * D + F));                    // n1_lp, n2_lp, att_lp, h_act_lp
  double total = static_cast<double>(c.n_layers) * layer;
  total += 4 * R * C * static_cast<double>(c.n_layers + 1);  // residual stream
  if (bf16) total += 4 * std::max(R * C, N * F);             // the shared f32 scratch
  total += 4 * R * 2 + norm_out * R * C + lp * R * C;        // final norm
  total += 4 * N * V + 4 * N;                                // logits (dlogits), losses
  total += 4 * (2 * R * C + N * (H * D + QKV + F + HPRE));   // backward scratch
  total += 4 * N * 2 * 2;                                    // tokens + targets, context and trainer
  if (llama) total += 4.0 * static_cast<double>(c.max_seq) * D;  // RoPE cos + sin tables
  if (tp > 1) {
    total += 4 * N * C;                    // partial products of row-parallel linears (and the SP embedding)
    total += 4 * N + 12 * N + 12 * N * tp;  // local tokens; cross-entropy partials, gathered
    if (c.n_kv_heads < tp) {                // shared KV rows: saved gradient, gathered over the group
      const double shared = 2 * KV * D * C;
      total += 4 * shared * (1 + tp);
    }
    if (sp) {
      total += (bf16 ? 2 : 4) * N * C;  // all-gathered input of a column-parallel linear
      total += 4 * N * C + 4 * N * C;   // all-gathered output gradient; input gradient before reduce-scatter
      total += 4 * R * C;               // reduce-scattered rows of a row-parallel output
      total += 4 * 4 * C;               // partial norm gradients
    }
  }
  return total;
}

}  // namespace

EngineMemory loom_engine_memory(const spec::TransformerConfig& cfg, const Layout& l, int64_t seq, bool bf16) {
  if (l.pp != 1 || l.cp != 1 || l.ep != 1)
    throw ConfigError("Loom's engine runs data and tensor parallelism (pp = cp = ep = 1), not " + l.str());
  // Rank 0's shard: under tp every rank holds the same amount, padding of the vocabulary aside (rank 0
  // holds whole rows and, with fewer KV heads than tp, the same one-head piece as every rank).
  const auto table = spec::build_param_table(cfg, {0, l.tp});
  const int dp = l.dp, stage = dp > 1 ? l.zero : 0;  // alone, every stage is the plain run
  const auto units = units_of(table, cfg.n_layers, dp);
  const double total = static_cast<double>(table.total_numel());
  double owned = 0;
  for (const auto& u : units) owned += static_cast<double>(u.owned());
  const double weight_bytes = 4 + (bf16 ? 2 : 0);  // f32 master (+ bf16 copy)

  // What a gathered unit adds on rank 0 (the other ranks' elements), for weights and for gradients.
  auto gathered_weights = [&](const Unit& u) {
    const double others = static_cast<double>(u.size() - u.owned());
    if (!bf16) return others * 4;
    return others * 2 + static_cast<double>(u.f32_read - u.f32_read_owned) * 4;  // bf16 copies + exact f32
  };
  auto gathered_grads = [&](const Unit& u) { return static_cast<double>(u.size() - u.owned()) * 4; };
  const Unit& embed = units.front();
  const Unit& head = units.back();
  double largest_block = 0, largest_block_grads = 0;
  for (size_t i = 1; i + 1 < units.size(); ++i) {
    largest_block = std::max(largest_block, gathered_weights(units[i]));
    largest_block_grads = std::max(largest_block_grads, gathered_grads(units[i]));
  }

  EngineMemory m;
  // ZeRO-3 holds the embeddings and head for the whole micro-batch and two blocks at a time (one in
  // use, the next prefetched). ZeRO-1/2 in bf16 keep the bf16 copies whole and, of the f32 masters,
  // this rank's pieces and every element read in f32.
  double f32_others = 0;
  for (const auto& u : units) f32_others += static_cast<double>(u.f32_read - u.f32_read_owned);
  if (stage == 3)
    m.parameters = owned * weight_bytes + gathered_weights(embed) + gathered_weights(head) + 2 * largest_block;
  else if (stage >= 1 && bf16)
    m.parameters = total * 2 + (owned + f32_others) * 4;
  else
    m.parameters = total * weight_bytes;
  // ZeRO-2/3 keep the embedding gradient for all of backward, and two other units' scratch: the one in
  // backward and the one whose reduction is still landing (the head's at first).
  m.gradients = stage >= 2 ? owned * 4 + gathered_grads(embed) +
                                 std::max(gathered_grads(head) + largest_block_grads, 2 * largest_block_grads)
                           : total * 4;
  m.optimizer = (stage >= 1 ? owned : total) * 8;  // AdamW m and v in f32
  m.activations = activation_bytes(cfg, table, l.micro_batch, seq, l.tp, l.sp && l.tp > 1, bf16);
  return m;
}

}  // namespace loom::plan
