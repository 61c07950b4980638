#include "loom/model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "loom/core/philox.h"
#include "loom/error.h"

namespace loom::model {

int32_t sample_token(std::span<const float> logits, const SamplingOptions& o, uint64_t index) {
  if (logits.empty()) throw ConfigError("cannot sample from empty logits");
  if (o.temperature < 0 || !std::isfinite(o.temperature))
    throw ConfigError("--temperature must be >= 0 (0 picks the most likely token)");
  const int64_t V = static_cast<int64_t>(logits.size());
  if (o.temperature == 0.0f)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t k = o.top_k > 0 ? std::min<int64_t>(o.top_k, V) : V;
  // Ties broken by index, so the candidate set does not depend on the sort's stability.
  auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  std::vector<double> p(static_cast<size_t>(k));
  const double mx = logits[idx[0]];
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += p[i] = std::exp((logits[idx[i]] - mx) / o.temperature);
  double u = static_cast<double>(Philox::uniform(o.seed, 0x5a3b1e, index)) * sum;
  for (int64_t i = 0; i < k; ++i) {
    if (u < p[i]) return idx[i];
    u -= p[i];
  }
  return idx[k - 1];
}

}  // namespace loom::model
