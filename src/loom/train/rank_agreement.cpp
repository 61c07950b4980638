#include "loom/train/rank_agreement.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "loom/core/checksum.h"
#include "loom/error.h"

namespace loom::train {

namespace {

uint64_t digest(const RankFact& f) {
  const std::string s = f.key + '\0' + f.value;
  return checksum64(s.data(), s.size());
}

// "0-2, 5" for ranks {0, 1, 2, 5}.
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s += (s.empty() ? "" : ", ") + (j > i ? fmt::format("{}-{}", ranks[i], ranks[j]) : std::to_string(ranks[i]));
    i = j + 1;
  }
  return s;
}

// Where each rank writes or reads its own files, or how fast it runs: may differ between ranks
// (another mount point on another node) without changing what is computed. The data itself is
// compared by content (data_facts).
bool rank_local(const std::string& key) {
  return key == "train.out_dir" || key == "trace.file" || key == "trace.summary" || key == "data.dir" ||
         key == "checkpoint.dir" || key == "train.threads";
}

}  // namespace

std::vector<RankFact> run_facts(const RunConfig& cfg, const spec::ParamTable& table, int world_size,
                                const std::string& build) {
  std::vector<RankFact> facts{{"loom build", build}, {"world size", std::to_string(world_size)}};
  for (auto& [key, value] : cfg.key_values())
    if (!rank_local(key)) facts.push_back({key, value});
  std::string layout;
  for (const auto& p : table.params()) {
    layout += p.name + "[";
    for (auto d : p.shape) layout += std::to_string(d) + ",";
    layout += "]@" + std::to_string(p.offset) + ":" + p.placement.str() + ";";
  }
  facts.push_back({"model.parameter_table", fmt::format("{} tensors, {} elements, hash {}", table.params().size(),
                                                        table.total_numel(),
                                                        checksum_hex(checksum64(layout.data(), layout.size())))});
  return facts;
}

std::vector<RankFact> data_facts(const TokenSource& data) { return {{"data", data.identity()}}; }

void check_ranks_agree(comm::ProcessGroup& group, const std::vector<RankFact>& facts, const std::string& what) {
  const int n = group.size();
  if (n == 1) return;
  // Round 1: the number of facts and one digest of them all. Nearly always the end.
  uint64_t all_digest = 0x9e3779b97f4a7c15ull;
  for (const auto& f : facts) all_digest = checksum64(&all_digest, sizeof all_digest) ^ digest(f);
  const uint64_t mine[2] = {facts.size(), all_digest};
  std::vector<uint64_t> heads(2 * static_cast<size_t>(n));
  group.all_gather(mine, heads.data(), 2, DType::I64).wait();
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && heads[2 * r] == heads[0] && heads[2 * r + 1] == heads[1];
  if (same) return;
  for (int r = 1; r < n; ++r)
    if (heads[2 * r] != heads[0])
      throw ConfigError(fmt::format("ranks disagree on {} before step 1: rank 0 has {} settings, rank {} has {}: they run "
                                    "different builds of loom; start every rank with the same binary",
                                    what, heads[0], group.ranks()[r], heads[2 * r]));

  // Round 2: one digest per fact, to find those that differ.
  std::vector<uint64_t> own(facts.size()), every(facts.size() * static_cast<size_t>(n));
  for (size_t i = 0; i < facts.size(); ++i) own[i] = digest(facts[i]);
  group.all_gather(own.data(), every.data(), own.size(), DType::I64).wait();
  std::vector<size_t> differ;
  for (size_t i = 0; i < facts.size(); ++i)
    for (int r = 1; r < n; ++r)
      if (every[r * facts.size() + i] != every[i]) {
        differ.push_back(i);
        break;
      }

  // Round 3: every rank's values of just those facts, to name them.
  std::string text;
  for (size_t i : differ) text += facts[i].key + '\0' + facts[i].value + '\0';
  text.resize((text.size() + 3) / 4 * 4, '\0');  // sent as 4-byte words
  const uint64_t words = text.size() / 4;
  std::vector<uint64_t> sizes(static_cast<size_t>(n));
  group.all_gather(&words, sizes.data(), 1, DType::I64).wait();
  std::vector<size_t> counts(sizes.begin(), sizes.end());
  size_t total = 0;
  for (auto c : counts) total += c;
  std::string all(4 * total, '\0');
  group.all_gather_v(text.data(), all.data(), counts, DType::I32).wait();

  std::string msg;
  size_t at = 0;
  std::vector<std::map<std::string, std::string>> values(static_cast<size_t>(n));  // rank -> key -> value
  for (int r = 0; r < n; ++r) {
    const size_t end = at + 4 * counts[r];
    while (at < end) {
      if (all[at] == '\0') {  // padding
        ++at;
        continue;
      }
      const size_t k = all.find('\0', at), v = all.find('\0', k + 1);
      values[r][all.substr(at, k - at)] = all.substr(k + 1, v - k - 1);
      at = v + 1;
    }
  }
  constexpr size_t kShown = 8;
  for (size_t j = 0; j < differ.size() && j < kShown; ++j) {
    const std::string& key = facts[differ[j]].key;
    std::map<std::string, std::vector<int>> by_value;
    for (int r = 0; r < n; ++r) by_value[values[r][key]].push_back(group.ranks()[r]);
    std::vector<std::pair<std::string, std::vector<int>>> holders(by_value.begin(), by_value.end());
    std::sort(holders.begin(), holders.end(), [](auto& a, auto& b) { return a.second.front() < b.second.front(); });
    std::string part;
    for (auto& [value, ranks] : holders)
      part += (part.empty() ? "" : " vs ") + fmt::format("{} on rank{} {}", value, ranks.size() > 1 ? "s" : "", rank_list(ranks));
    msg += (msg.empty() ? "" : "; ") + key + ": " + part;
  }
  if (differ.size() > kShown) msg += fmt::format("; and {} more", differ.size() - kShown);
  // One rank says what differs; the others only that they stop, so a large job prints one full line.
  // They leave after it does: a rank that exited first would have the launcher stop rank 0 before it
  // could print. (Rank 0 never enters this barrier; its exit ends the wait: peer_liveness.h.)
  if (group.rank() != 0) {
    try {
      group.barrier().wait();
    } catch (const CommError&) {
    }
    throw ConfigError(fmt::format("rank {} stops before step 1: ranks disagree on {} (group rank 0 names what)",
                                  group.ranks()[group.rank()], what));
  }
  throw ConfigError(fmt::format("ranks disagree on {} before step 1 (start every rank with the same config and data): {}",
                                what, msg));
}

}  // namespace loom::train
