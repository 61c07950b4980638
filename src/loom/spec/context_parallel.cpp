#include "loom/spec/context_parallel.h"

#include <string>

#include "loom/error.h"
#include "loom/spec/param_table.h"

namespace loom::spec {

const char* cp_mode_name(CpMode m) { return m == CpMode::Ring ? "ring" : "all-to-all"; }

CpMode parse_cp_mode(const std::string& s) {
  if (s == "ring") return CpMode::Ring;
  if (s == "all-to-all") return CpMode::AllToAll;
  throw ConfigError("parallel.cp_mode = \"" + s + "\" is not a context-parallel mode (valid: \"ring\", \"all-to-all\")");
}

std::vector<int32_t> context_positions(int64_t T, int cp, int rank) {
  std::vector<int32_t> pos;
  pos.reserve(static_cast<size_t>(T / cp));
  if (cp == 1) {
    for (int64_t t = 0; t < T; ++t) pos.push_back(static_cast<int32_t>(t));
    return pos;
  }
  const int64_t chunk = T / (2 * cp);
  for (const int64_t c : {int64_t{rank}, int64_t{2 * cp - 1 - rank}})
    for (int64_t t = c * chunk; t < (c + 1) * chunk; ++t) pos.push_back(static_cast<int32_t>(t));
  return pos;
}

void validate_context_parallel(const TransformerConfig& cfg, int64_t T, int cp, CpMode mode, int tp) {
  if (cp <= 1) return;
  const std::string n = std::to_string(cp);
  if (T % (2 * cp) != 0) {
    const int64_t step = 2 * cp, below = T / step * step;
    throw ConfigError("parallel.cp = " + n + " cuts each sample into 2 x cp = " + std::to_string(step) +
                      " equal chunks (head and tail per rank, so causal work is balanced), which train.seq_len = " +
                      std::to_string(T) + " does not divide; use train.seq_len = " +
                      (below > 0 ? std::to_string(below) + " or " : "") + std::to_string(below + step));
  }
  if (mode != CpMode::AllToAll) return;
  const int64_t heads = cfg.n_heads / tp, kv = kv_heads_per_rank(cfg, tp);
  const std::string where = tp > 1 ? " per tensor-parallel rank (tp = " + std::to_string(tp) + ")" : "";
  if (heads % cp != 0 || kv % cp != 0)
    throw ConfigError("parallel.cp_mode = \"all-to-all\" gives each of the cp = " + n +
                      " ranks whole attention heads, but the model has " + std::to_string(heads) + " query and " +
                      std::to_string(kv) + " KV heads" + where + ", which cp does not divide; use a cp that divides both, "
                      "or parallel.cp_mode = \"ring\"");
}

}  // namespace loom::spec
