#include "loom/spec/param_table.h"

#include <algorithm>

#include <cmath>

#include "loom/error.h"

namespace loom::spec {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (auto d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw ConfigError("parameter '" + name + "' has a shape whose size does not fit in 64 bits");
  return n;
}

namespace {
// The block index in a Hugging Face name ("transformer.h.3.attn..." / "model.layers.3.mlp..."), or -1.
int64_t block_of(const std::string& name) {
  for (const char* key : {".h.", ".layers."}) {
    auto at = name.find(key);
    if (at == std::string::npos) continue;
    size_t i = at + std::char_traits<char>::length(key);
    int64_t v = 0;
    bool digits = false;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i, digits = true) v = v * 10 + (name[i] - '0');
    if (digits && i < name.size() && name[i] == '.') return v;
  }
  return -1;
}
}  // namespace

std::vector<int64_t> ParamTable::block_starts(int64_t n_layers) const {
  std::vector<int64_t> starts(n_layers + 1, total_);
  int64_t blocks_end = 0;
  for (const auto& p : params_) {
    const int64_t b = block_of(p.name);
    if (b >= 0 && b < n_layers) {
      starts[b] = std::min(starts[b], p.offset);
      blocks_end = std::max(blocks_end, p.offset + p.numel());
    }
  }
  starts[n_layers] = blocks_end;
  // A block this shard does not hold (another pipeline stage's) is empty where the next one starts, so
  // the units between held blocks stay each their own (ZeRO's units, the checkpoint's split).
  for (int64_t l = n_layers - 1; l >= 0; --l) starts[l] = std::min(starts[l], starts[l + 1]);
  return starts;
}

namespace {
// The extents of one sharded dimension: `block` of the whole tensor's per block, `piece` of this shard's
// per block (padded up when the pieces do not divide the block).
struct ShardExtent {
  int64_t block = 0, piece = 0, pieces = 1, my_piece = 0;
};
ShardExtent extent_of(const AxisPlacement& a, int64_t global, const TableShard& s) {
  ShardExtent e;
  e.pieces = a.pieces > 0 ? a.pieces : s.tp_size;
  e.block = global / a.blocks;
  e.piece = (e.block + e.pieces - 1) / e.pieces;
  e.my_piece = static_cast<int64_t>(s.tp_rank) * e.pieces / s.tp_size;
  return e;
}
}  // namespace

int64_t ParamTable::global_element(const ParamSpec& p, int64_t local) const {
  const AxisPlacement& a = p.placement.on(MeshAxis::TP);
  if (shard_.whole() || !a.is_shard()) return local;
  // Row-major strides of the local and the whole tensor; only the sharded dimension maps differently.
  const int nd = static_cast<int>(p.shape.size());
  int64_t global = 0, stride_local = 1, stride_global = 1;
  const ShardExtent e = extent_of(a, p.global_shape[a.dim], shard_);
  for (int d = nd - 1; d >= 0; --d) {
    const int64_t i = (local / stride_local) % p.shape[d];
    int64_t g = i;
    if (d == a.dim) {
      const int64_t b = i / e.piece, w = i % e.piece, within = e.my_piece * e.piece + w;
      if (within >= e.block) return -1;  // padding
      g = b * e.block + within;
    }
    global += g * stride_global;
    stride_local *= p.shape[d];
    stride_global *= p.global_shape[d];
  }
  return global;
}

void ParamTable::for_each_global_run(const ParamSpec& p, int64_t begin, int64_t end,
                                     const std::function<void(int64_t, int64_t, int64_t)>& f) const {
  const AxisPlacement& a = p.placement.on(MeshAxis::TP);
  if (shard_.whole() || !a.is_shard()) {
    if (begin < end) f(begin, begin, end - begin);
    return;
  }
  // The dimensions after the sharded one are whole, so the global elements are consecutive while the
  // index along the sharded dimension stays within one piece (and on one side of its padding) and the
  // dimensions before it do not change: a run spans whole rows of a dim-0 shard, a piece of each row of
  // a last-dim shard.
  const int64_t inner = [&] {
    int64_t n = 1;
    for (size_t d = static_cast<size_t>(a.dim) + 1; d < p.shape.size(); ++d) n *= p.shape[d];
    return n;
  }();
  const int64_t along = p.shape[static_cast<size_t>(a.dim)];
  const ShardExtent e = extent_of(a, p.global_shape[static_cast<size_t>(a.dim)], shard_);
  const int64_t valid = e.block - e.my_piece * e.piece;  // elements of each piece that are not padding
  for (int64_t l = begin; l < end;) {
    const int64_t outer_start = l - l % (along * inner);
    const int64_t i = (l / inner) % along, piece_start = i / e.piece * e.piece, w = i - piece_start;
    const int64_t end_i = piece_start + (w < valid ? std::min(valid, e.piece) : e.piece);
    const int64_t stop = std::min(end, outer_start + end_i * inner);
    f(l, global_element(p, l), stop - l);
    l = stop;
  }
}

bool TableShard::holds_block(int64_t b) const {
  if (blocks.empty()) return true;
  for (const auto& [lo, hi] : blocks)
    if (b >= lo && b < hi) return true;
  return false;
}

namespace {
// Whether a pipeline shard holds the tensor `name` (tied: the head is the token embedding).
bool holds(const TableShard& s, const std::string& name, bool tied) {
  if (s.every_layer()) return true;
  if (const int64_t b = block_of(name); b >= 0) return s.holds_block(b);
  if (name == "transformer.wpe.weight") return s.embeddings;
  if (name == "transformer.wte.weight" || name == "model.embed_tokens.weight") return s.embeddings || (s.head && tied);
  return s.head;  // final norm, untied head
}
}  // namespace

void ParamTable::add(ParamSpec p) {
  if (!holds(shard_, p.name, tied_)) return;
  // A hash index keeps building the table linear in the number of tensors.
  if (!index_.emplace(p.name, params_.size()).second) throw ConfigError("parameter '" + p.name + "' defined twice");
  p.global_shape = p.shape;
  if (const AxisPlacement& a = p.placement.on(MeshAxis::TP); !shard_.whole() && a.is_shard()) {
    const ShardExtent e = extent_of(a, p.global_shape[a.dim], shard_);
    p.shape[a.dim] = e.piece * a.blocks;
  }
  // Keep every tensor 64-byte aligned in an f32 arena so vector kernels can assume it.
  const int64_t numel = p.numel();
  total_ = (total_ + 15) / 16 * 16;
  p.offset = total_;
  if (__builtin_add_overflow(total_, numel, &total_))
    throw ConfigError("the parameter table's size overflows 64 bits at '" + p.name + "'");
  params_.push_back(std::move(p));
}

int64_t ParamTable::non_embedding_numel() const {
  int64_t n = 0;
  for (auto& p : params_)
    if (p.name != "transformer.wte.weight" && p.name != "transformer.wpe.weight" &&
        p.name != "model.embed_tokens.weight" && p.name != "lm_head.weight")
      n += p.numel();
  return n;
}

std::optional<size_t> ParamTable::index_of(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

const ParamSpec& ParamTable::at(const std::string& name) const {
  auto i = index_of(name);
  if (!i) throw ConfigError("no parameter named '" + name + "' in this model");
  return params_[*i];
}

namespace {

// Tensor-parallel placements (Megatron-LM): a column-parallel GEMM splits its output rows, a
// row-parallel one its input columns; `blocks` keeps a fused matrix's parts (GPT-2's q/k/v) whole-wise.
Placement tp_rows(int blocks = 1, int pieces = 0) {
  return Placement::replicate().with(MeshAxis::TP, AxisPlacement::shard(0, blocks, pieces));
}
Placement tp_cols() { return Placement::replicate().with(MeshAxis::TP, AxisPlacement::shard(1)); }

ParamSpec matrix(std::string name, int64_t out, int64_t in, float std, Placement placement) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = {out, in};
  p.init = {Init::Kind::Normal, std};
  p.placement = placement;
  p.weight_decay = true;
  return p;
}
// A matrix only GEMMs read (not an embedding table).
ParamSpec linear(std::string name, int64_t out, int64_t in, float std, Placement placement) {
  ParamSpec p = matrix(std::move(name), out, in, std, placement);
  p.gemm_only = true;
  return p;
}
ParamSpec vec(std::string name, int64_t n, Init::Kind kind, Placement placement = Placement::replicate()) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = {n};
  p.init = {kind, 0.0f};
  p.placement = placement;
  return p;
}

// A mixture-of-experts MLP (Mixtral's names under `prefix`): the router, the shared experts' SwiGLU MLP,
// then per routed expert its gate (w1), up (w3) and down (w2) projections, so each expert's gate|up rows
// are adjacent (one GEMM) and each expert's weights one contiguous piece of the arena.
void add_moe(ParamTable& t, const TransformerConfig& c, const std::string& prefix, float resid_std) {
  const int64_t C = c.d_model, Fe = c.expert_width(), E = c.moe.experts;
  // The router runs in f32 in every precision (a bf16 rounding of its scores would flip near-tied
  // choices), so it is read as a whole tensor, not only as a GEMM's bf16 copy.
  t.add(matrix(prefix + "gate.weight", E, C, c.init_std, Placement::replicate()));
  // Auxiliary-loss-free balancing: the selection bias (DeepSeek-V3's name). Not trained -- its gradient
  // is zero, so AdamW leaves it alone -- but moved by the trainer after each step, and a weight like any
  // other for checkpoints, layouts and export.
  if (c.moe.bias_update_rate > 0) t.add(vec(prefix + "gate.e_score_correction_bias", E, Init::Kind::Zeros));
  if (c.moe.shared_experts > 0) {
    const int64_t Fs = c.moe.shared_experts * Fe;
    t.add(linear(prefix + "shared_experts.gate_proj.weight", Fs, C, c.init_std, tp_rows()));
    t.add(linear(prefix + "shared_experts.up_proj.weight", Fs, C, c.init_std, tp_rows()));
    t.add(linear(prefix + "shared_experts.down_proj.weight", C, Fs, resid_std, tp_cols()));
  }
  // The routed experts come last in the block: ZeRO shards them over other ranks than the rest
  // (spec::zero_shard_plans), one range per block.
  const auto [first, last] = local_experts(c, t.shard());
  for (int64_t e = first; e < last; ++e) {
    const std::string x = prefix + "experts." + std::to_string(e) + ".";
    // Under tensor parallelism every expert is split like a dense MLP: gate and up by rows, down by
    // columns (each tp rank runs every token through its slice of every expert).
    for (ParamSpec p : {linear(x + "w1.weight", Fe, C, c.init_std, tp_rows()),
                        linear(x + "w3.weight", Fe, C, c.init_std, tp_rows()),
                        linear(x + "w2.weight", C, Fe, resid_std, tp_cols())}) {
      p.expert = true;
      t.add(std::move(p));
    }
  }
}

void add_gpt2(ParamTable& t, const TransformerConfig& c) {
  const int64_t C = c.d_model;
  // GPT-2 scales the init of projections that write into the residual stream by 1/sqrt(2L),
  // so the residual's variance does not grow with depth.
  const float resid_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers));
  t.add(matrix("transformer.wte.weight", c.vocab_size, C, c.init_std, tp_rows()));  // vocabulary-parallel
  t.add(matrix("transformer.wpe.weight", c.max_seq, C, c.init_std, Placement::replicate()));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    std::string p = "transformer.h." + std::to_string(l) + ".";
    t.add(vec(p + "ln_1.weight", C, Init::Kind::Ones));
    t.add(vec(p + "ln_1.bias", C, Init::Kind::Zeros));
    // q, k and v each split by heads: three blocks of rows, not the fused matrix's rows.
    t.add(linear(p + "attn.c_attn.weight", 3 * C, C, c.init_std, tp_rows(3)));
    t.add(vec(p + "attn.c_attn.bias", 3 * C, Init::Kind::Zeros, tp_rows(3)));
    t.add(linear(p + "attn.c_proj.weight", C, C, resid_std, tp_cols()));
    t.add(vec(p + "attn.c_proj.bias", C, Init::Kind::Zeros));
    t.add(vec(p + "ln_2.weight", C, Init::Kind::Ones));
    t.add(vec(p + "ln_2.bias", C, Init::Kind::Zeros));
    if (c.is_moe_layer(l)) {
      add_moe(t, c, moe_param_prefix(c, l), resid_std);
      continue;
    }
    t.add(linear(p + "mlp.c_fc.weight", c.d_ff, C, c.init_std, tp_rows()));
    t.add(vec(p + "mlp.c_fc.bias", c.d_ff, Init::Kind::Zeros, tp_rows()));
    t.add(linear(p + "mlp.c_proj.weight", C, c.d_ff, resid_std, tp_cols()));
    t.add(vec(p + "mlp.c_proj.bias", C, Init::Kind::Zeros));
  }
  t.add(vec("transformer.ln_f.weight", C, Init::Kind::Ones));
  t.add(vec("transformer.ln_f.bias", C, Init::Kind::Zeros));
  if (!c.tie_embeddings) t.add(linear("lm_head.weight", c.vocab_size, C, c.init_std, tp_rows()));
}

void add_llama(ParamTable& t, const TransformerConfig& c) {
  const int64_t C = c.d_model, hd = c.head_dim();
  const float resid_std = c.init_std / std::sqrt(2.0f * static_cast<float>(c.n_layers));
  t.add(matrix("model.embed_tokens.weight", c.vocab_size, C, c.init_std, tp_rows()));
  // KV heads split like the query heads while there are at least tp of them; fewer are replicated, each
  // over the ranks whose query heads share it (8 KV heads at tp = 16 or 32, as real Llama runs use).
  const int tp = t.shard().tp_size;
  const Placement kv = c.n_kv_heads >= tp ? tp_rows() : tp_rows(1, static_cast<int>(c.n_kv_heads));
  for (int64_t l = 0; l < c.n_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    t.add(vec(p + "input_layernorm.weight", C, Init::Kind::Ones));
    t.add(linear(p + "self_attn.q_proj.weight", c.n_heads * hd, C, c.init_std, tp_rows()));
    t.add(linear(p + "self_attn.k_proj.weight", c.n_kv_heads * hd, C, c.init_std, kv));
    t.add(linear(p + "self_attn.v_proj.weight", c.n_kv_heads * hd, C, c.init_std, kv));
    t.add(linear(p + "self_attn.o_proj.weight", C, c.n_heads * hd, resid_std, tp_cols()));
    t.add(vec(p + "post_attention_layernorm.weight", C, Init::Kind::Ones));
    if (c.is_moe_layer(l)) {
      add_moe(t, c, moe_param_prefix(c, l), resid_std);
      continue;
    }
    t.add(linear(p + "mlp.gate_proj.weight", c.d_ff, C, c.init_std, tp_rows()));
    t.add(linear(p + "mlp.up_proj.weight", c.d_ff, C, c.init_std, tp_rows()));
    t.add(linear(p + "mlp.down_proj.weight", C, c.d_ff, resid_std, tp_cols()));
  }
  t.add(vec("model.norm.weight", C, Init::Kind::Ones));
  if (!c.tie_embeddings) t.add(linear("lm_head.weight", c.vocab_size, C, c.init_std, tp_rows()));
}

// Degrees in [1, limit] that divide n, for "valid tp" hints.
std::string divisors(int64_t n, int64_t limit) {
  std::string s;
  for (int64_t d = 1; d <= std::min(n, limit); ++d)
    if (n % d == 0) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

}  // namespace

std::pair<int64_t, int64_t> local_experts(const TransformerConfig& cfg, const TableShard& shard) {
  const int64_t per = cfg.moe.experts / shard.ep_size;
  return {shard.ep_rank * per, (shard.ep_rank + 1) * per};
}

std::vector<ArenaRange> expert_ranges(const ParamTable& table) {
  std::vector<ArenaRange> out;
  for (const auto& p : table.params()) {
    if (!p.expert) continue;
    if (!out.empty() && out.back().end == p.offset)
      out.back().end = p.offset + p.numel();
    else
      out.push_back({p.offset, p.offset + p.numel()});
  }
  return out;
}

std::vector<ArenaRange> subtract(const std::vector<ArenaRange>& a, const std::vector<ArenaRange>& b) {
  std::vector<ArenaRange> out;
  size_t j = 0;
  for (ArenaRange r : a) {
    while (j < b.size() && b[j].end <= r.begin) ++j;
    for (size_t k = j; k < b.size() && b[k].begin < r.end; ++k) {
      if (b[k].begin > r.begin) out.push_back({r.begin, b[k].begin});
      r.begin = std::max(r.begin, b[k].end);
    }
    if (r.begin < r.end) out.push_back(r);
  }
  return out;
}

std::string moe_param_prefix(const TransformerConfig& cfg, int64_t layer) {
  return cfg.arch == Arch::Llama ? "model.layers." + std::to_string(layer) + ".block_sparse_moe."
                                 : "transformer.h." + std::to_string(layer) + ".moe.";
}

void validate_tensor_parallel(const TransformerConfig& c, int tp) {
  if (tp < 1) throw ConfigError("parallel.tp = " + std::to_string(tp) + " must be at least 1");
  if (tp == 1) return;
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError(msg);
  };
  const std::string t = std::to_string(tp);
  need(c.n_heads % tp == 0, "parallel.tp = " + t + " does not divide model.n_heads = " + std::to_string(c.n_heads) +
                                " (each tp rank runs whole heads); valid tp: " + divisors(c.n_heads, 4096));
  need(tp_splits_kv_heads(c, tp),
       "parallel.tp = " + t + " and model.n_kv_heads = " + std::to_string(c.n_kv_heads) +
           ": one must divide the other (KV heads are split over tp, or each replicated over tp / n_kv_heads ranks)");
  need(c.d_ff % tp == 0, "parallel.tp = " + t + " does not divide model.d_ff = " + std::to_string(c.d_ff) +
                             " (the MLP is split by columns); valid tp: " + divisors(c.d_ff, 64) + (c.d_ff > 64 ? ", ..." : ""));
  if (c.moe.enabled()) {
    const int64_t Fe = c.expert_width();
    need(Fe % tp == 0, "parallel.tp = " + t + " does not divide the expert width " + std::to_string(Fe) +
                           " (model.moe.d_expert; every expert is split by columns); valid tp: " + divisors(Fe, 64) +
                           (Fe > 64 ? ", ..." : ""));
  }
}

ParamTable build_param_table(const TransformerConfig& cfg, TableShard shard) {
  cfg.validate();
  validate_tensor_parallel(cfg, shard.tp_size);
  if (shard.ep_size < 1 || shard.ep_rank < 0 || shard.ep_rank >= shard.ep_size ||
      (shard.ep_size > 1 && (!cfg.moe.enabled() || cfg.moe.experts % shard.ep_size != 0)))
    throw ConfigError("expert-parallel rank " + std::to_string(shard.ep_rank) + " of ep = " + std::to_string(shard.ep_size) +
                      " cannot split model.moe.experts = " + std::to_string(cfg.moe.experts));
  if (shard.tp_rank < 0 || shard.tp_rank >= shard.tp_size)
    throw ConfigError("tensor-parallel rank " + std::to_string(shard.tp_rank) + " is outside tp = " +
                      std::to_string(shard.tp_size));
  if (!shard.every_layer() && !shard.embeddings && !shard.head && shard.blocks.empty())
    throw Error("internal: a pipeline shard must hold something");
  ParamTable t(shard);
  t.set_tied(cfg.tie_embeddings);
  if (cfg.arch == Arch::GPT2)
    add_gpt2(t, cfg);
  else
    add_llama(t, cfg);
  return t;
}

void ParamTable::shard_flat_along(MeshAxis axis) {
  for (auto& p : params_) p.placement = p.placement.with(axis, AxisPlacement::flat());
}

std::vector<ArenaRange> counted_ranges(const ParamTable& table) {
  const TableShard& sh = table.shard();
  std::vector<ArenaRange> out;
  for (const auto& p : table.params()) {
    const AxisPlacement& a = p.placement.on(MeshAxis::TP);
    const int pieces = !a.is_shard() ? 1 : a.pieces > 0 ? std::min(a.pieces, sh.tp_size) : sh.tp_size;
    const int holders = sh.tp_size / pieces;  // ranks holding each piece
    if (sh.tp_rank % holders != 0) continue;
    const ArenaRange r{p.offset, p.offset + p.numel()};
    if (!out.empty() && out.back().end == r.begin)
      out.back().end = r.end;
    else
      out.push_back(r);
  }
  return out;
}

std::vector<ArenaRange> intersect(const std::vector<ArenaRange>& a, const std::vector<ArenaRange>& b) {
  std::vector<ArenaRange> out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].begin, b[j].begin), hi = std::min(a[i].end, b[j].end);
    if (lo < hi) out.push_back({lo, hi});
    (a[i].end < b[j].end) ? ++i : ++j;
  }
  return out;
}

}  // namespace loom::spec
