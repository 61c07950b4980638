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

std::vector<Unit> units_of(const spec::ParamTable& table, int64_t n_layers, int dp) {
  const spec::ShardPlan plan(spec::unit_bounds_from_blocks(table.block_starts(n_layers), table.total_numel()), dp);
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

// Activations of one micro-batch context, as model::Transformer::make_context allocates them, plus the
// trainer's token and target buffers.
double activation_bytes(const spec::TransformerConfig& c, int64_t B, int64_t T, bool bf16) {
  const double N = static_cast<double>(B * T), C = static_cast<double>(c.d_model);
  const double H = static_cast<double>(c.n_heads), D = static_cast<double>(c.head_dim());
  const double F = static_cast<double>(c.d_ff), V = static_cast<double>(c.vocab_size);
  const double QKV = (H + 2.0 * static_cast<double>(c.n_kv_heads)) * D;
  const bool llama = c.arch == spec::Arch::Llama;
  const double HPRE = llama ? 2 * F : F;
  const double lp = bf16 ? 2 : 0;                            // bf16 copies of GEMM inputs
  const double norm_out = bf16 ? 0 : 4;                      // f32 norm / activation outputs (bf16: one scratch)
  double layer = 4 * N * (2 + QKV + H + H * D + C + 2 + HPRE)  // norm stats, qkv, lse, att, x_mid, h_pre
                 + norm_out * N * (C + C + F)                  // n1_out, n2_out, h_act
                 + lp * N * (C + H * D + C + F);               // n1_lp, att_lp, n2_lp, h_act_lp
  double total = static_cast<double>(c.n_layers) * layer;
  total += 4 * N * C * static_cast<double>(c.n_layers + 1);  // residual stream
  if (bf16) total += 4 * N * std::max(C, F);                 // the shared f32 scratch
  total += 4 * N * 2 + norm_out * N * C + lp * N * C;        // final norm
  total += 4 * N * V + 4 * N;                                // logits (dlogits), losses
  total += 4 * N * (C + C + H * D + QKV + F + HPRE);         // backward scratch
  total += 4 * N * 2 * 2;                                    // tokens + targets, context and trainer
  if (llama) total += 4.0 * static_cast<double>(c.max_seq) * D;  // RoPE cos + sin tables
  return total;
}

}  // namespace

EngineMemory loom_engine_memory(const spec::TransformerConfig& cfg, const Layout& l, int64_t seq, bool bf16) {
  if (l.tp != 1 || l.pp != 1 || l.cp != 1 || l.ep != 1)
    throw ConfigError("Loom's engine runs data parallelism only (tp = pp = cp = ep = 1), not " + l.str());
  const auto table = spec::build_param_table(cfg);
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
  m.activations = activation_bytes(cfg, l.micro_batch, seq, bf16);
  return m;
}

}  // namespace loom::plan
