#include "loom/spec/pipeline_stages.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "loom/error.h"

namespace loom::spec {

int64_t PipelineStages::first_layer(int chunk) const {
  return std::accumulate(layers.begin(), layers.begin() + chunk, int64_t{0});
}

int64_t PipelineStages::blocks_on(int rank) const {
  int64_t n = 0;
  for (size_t g = static_cast<size_t>(rank); g < layers.size(); g += static_cast<size_t>(pp)) n += layers[g];
  return n;
}

std::string PipelineStages::str() const {
  std::string s;
  for (int64_t n : layers) {
    if (!s.empty()) s += ',';
    s += std::to_string(n);
  }
  return s;
}

TableShard PipelineStages::shard_of(int rank) const {
  TableShard s;
  for (int g = rank; g < chunks(); g += pp) {
    const int64_t first = first_layer(g);
    s.blocks.push_back({first, first + layers[static_cast<size_t>(g)]});
  }
  s.embeddings = rank == 0;
  s.head = rank_of(chunks() - 1) == rank;
  return s;
}

double block_cost(const TransformerConfig& c, int64_t seq) {
  const double C = static_cast<double>(c.d_model), D = static_cast<double>(c.head_dim());
  const double H = static_cast<double>(c.n_heads), KV = static_cast<double>(c.n_kv_heads);
  const double F = static_cast<double>(c.d_ff);
  const double mlp = c.arch == Arch::Llama ? 3 * C * F : 2 * C * F;
  const double params = C * (H + 2 * KV) * D + H * D * C + mlp;
  return 6 * params + 6 * static_cast<double>(seq) * C;
}

double head_cost(const TransformerConfig& c) {
  return 6 * static_cast<double>(c.vocab_size) * static_cast<double>(c.d_model);
}

namespace {

// The fewest-cost contiguous split of L equal blocks (cost b each) into K chunks of at least one block,
// chunk K - 1 also carrying `tail`: binary search on the largest chunk's cost, each candidate checked
// greedily (fill each chunk while it fits, leaving a block for every later chunk).
std::vector<int64_t> balance(int64_t L, int K, double b, double tail) {
  auto fill = [&](double cap, std::vector<int64_t>& out) {
    out.assign(static_cast<size_t>(K), 0);
    int64_t left = L;
    for (int k = 0; k < K; ++k) {
      const int64_t later = K - 1 - k;
      const double extra = k == K - 1 ? tail : 0;
      int64_t n = k == K - 1 ? left : std::max<int64_t>(1, static_cast<int64_t>(std::floor((cap - extra) / b + 1e-9)));
      n = std::min(n, left - later);
      if (n < 1 || extra + b * static_cast<double>(n) > cap * (1 + 1e-12)) return false;
      out[static_cast<size_t>(k)] = n;
      left -= n;
    }
    return left == 0;
  };
  double lo = b, hi = b * static_cast<double>(L) + tail;
  std::vector<int64_t> best, trial;
  fill(hi, best);
  for (int it = 0; it < 100 && hi - lo > 1e-9 * hi; ++it) {
    const double mid = 0.5 * (lo + hi);
    if (fill(mid, trial)) {
      hi = mid;
      best = trial;
    } else {
      lo = mid;
    }
  }
  return best;
}

// With virtual stages a rank runs several chunks, so chunks of equal cost can still leave the ranks
// unequal (mini, 6 blocks and a heavy head on 2 x 2 chunks: 2,2,1,1 gives the head's rank 4.8 block
// costs and the other 3). Moves single blocks between neighbouring chunks while no chunk grows past the
// balanced split's largest, for the smallest largest rank, then the most even ranks.
std::vector<int64_t> even_ranks(std::vector<int64_t> layers, int pp, double b, double tail) {
  const int K = static_cast<int>(layers.size());
  auto chunk_cost = [&](int k) { return b * static_cast<double>(layers[static_cast<size_t>(k)]) + (k == K - 1 ? tail : 0); };
  double cap = 0;
  for (int k = 0; k < K; ++k) cap = std::max(cap, chunk_cost(k));
  auto score = [&] {
    std::vector<double> rank(static_cast<size_t>(pp), 0.0);
    for (int k = 0; k < K; ++k) rank[static_cast<size_t>(k % pp)] += chunk_cost(k);
    double worst = 0, squares = 0;
    for (double r : rank) worst = std::max(worst, r), squares += r * r;
    return std::pair{worst, squares};
  };
  auto best = score();
  for (bool moved = true; moved;) {
    moved = false;
    for (int k = 0; k + 1 < K && !moved; ++k)
      for (int dir : {+1, -1}) {  // +1: a block from chunk k to k + 1; -1: back
        auto& from = layers[static_cast<size_t>(dir > 0 ? k : k + 1)];
        auto& to = layers[static_cast<size_t>(dir > 0 ? k + 1 : k)];
        if (from <= 1) continue;
        --from, ++to;
        const auto now = score();
        const bool fits = chunk_cost(k) <= cap * (1 + 1e-12) && chunk_cost(k + 1) <= cap * (1 + 1e-12);
        if (fits && (now.first < best.first * (1 - 1e-12) ||
                     (now.first <= best.first * (1 + 1e-12) && now.second < best.second * (1 - 1e-12)))) {
          best = now, moved = true;
          break;
        }
        ++from, --to;
      }
  }
  return layers;
}

}  // namespace

std::vector<int64_t> trimmed_ends(int64_t L, int K) {
  if (K < 1 || L < K)
    throw ConfigError(std::to_string(L) + " blocks cannot be cut into " + std::to_string(K) +
                      " pipeline chunks of at least one block each");
  const int64_t q = L / K, light = K - L % K;  // `light` chunks of q blocks, the rest q + 1
  std::vector<int64_t> layers(static_cast<size_t>(K), q + 1);
  for (int64_t i = 0; i < light; ++i) {
    const int64_t pos = i % 2 == 0 ? i / 2 : K - 1 - i / 2;  // 0, K-1, 1, K-2, ...
    layers[static_cast<size_t>(pos)] = q;
  }
  return layers;
}

PipelineStages cut_pipeline(const TransformerConfig& cfg, int64_t seq, int pp, int v,
                            const std::vector<int64_t>& explicit_layers) {
  PipelineStages s;
  s.pp = pp, s.v = v;
  const int K = pp * v;
  const int64_t L = cfg.n_layers;
  if (pp < 1 || v < 1)
    throw ConfigError("parallel.pp = " + std::to_string(pp) + " and parallel.pipeline.virtual_stages = " +
                      std::to_string(v) + " must both be at least 1");
  if (explicit_layers.empty()) {
    if (L < K)
      throw ConfigError("model.n_layers = " + std::to_string(L) + " cannot give pp x virtual_stages = " +
                        std::to_string(pp) + " x " + std::to_string(v) + " = " + std::to_string(K) +
                        " chunks a block each; use at most " + std::to_string(std::max<int64_t>(1, L / pp)) +
                        " virtual stages" + (L >= pp ? "" : " and pp <= " + std::to_string(L)));
    s.layers = balance(L, K, block_cost(cfg, seq), head_cost(cfg));
    if (v > 1) s.layers = even_ranks(s.layers, pp, block_cost(cfg, seq), head_cost(cfg));
    return s;
  }
  auto example = [&] { return L >= K ? PipelineStages{pp, v, balance(L, K, 1.0, 0.0)}.str() : std::string("?"); };
  if (static_cast<int>(explicit_layers.size()) != K)
    throw ConfigError("parallel.pipeline.layers lists " + std::to_string(explicit_layers.size()) +
                      " block counts, but pp x virtual_stages = " + std::to_string(K) + " chunks need one each (e.g. \"" +
                      example() + "\")");
  int64_t sum = 0;
  for (int64_t n : explicit_layers) {
    if (n < 0) throw ConfigError("parallel.pipeline.layers has a negative block count (" + std::to_string(n) + ")");
    sum += n;
  }
  if (sum != L)
    throw ConfigError("parallel.pipeline.layers sums to " + std::to_string(sum) + " blocks, but model.n_layers = " +
                      std::to_string(L) + " (e.g. \"" + example() + "\")");
  s.layers = explicit_layers;
  return s;
}

std::vector<int64_t> parse_layer_counts(const std::string& text, const std::string& key) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= text.size() && !text.empty()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    char* stop = nullptr;
    const long long n = std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || n < 0 || n > (1 << 24))
      throw ConfigError(key + " = \"" + text + "\" is not a comma-separated list of block counts (e.g. \"7,8,8,7\")");
    out.push_back(n);
    start = end + 1;
  }
  return out;
}

}  // namespace loom::spec
