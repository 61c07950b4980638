#include "loom/comm/rendezvous.h"

#include <fmt/format.h>

#include <algorithm>

#include "loom/error.h"

namespace loom::comm {

std::vector<std::string> store_all_gather(Store& store, const std::string& key, int rank, const std::vector<int>& ranks,
                                          const std::string& value, Clock::time_point deadline) {
  const int n = static_cast<int>(ranks.size());
  store.set(fmt::format("{}/{}", key, rank), value);
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(fmt::format("{}/{}", key, r));
  // Wait in short slices so the error can say exactly which ranks are missing at the deadline.
  for (;;) {
    auto missing = store.missing(keys);
    if (missing.empty()) break;
    auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int> absent;
      for (const auto& k : missing) absent.push_back(ranks[std::stoi(k.substr(key.size() + 1))]);
      std::sort(absent.begin(), absent.end());
      throw CommTimeoutError(fmt::format(
          "rank {}: rendezvous '{}' timed out: rank(s) {} never arrived (group ranks [{}]); raise "
          "LOOM_COMM_TIMEOUT if they are just slow to start",
          ranks[rank], key, fmt::join(absent, ", "), fmt::join(ranks, ", ")));
    }
    auto slice = std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(200));
    try {
      store.wait(missing, std::chrono::duration_cast<std::chrono::milliseconds>(slice) + std::chrono::milliseconds(1));
    } catch (const CommTimeoutError&) {
      // re-checked above
    }
  }
  std::vector<std::string> values;
  for (const auto& k : keys) values.push_back(*store.try_get(k));
  return values;
}

void store_barrier(Store& store, const std::string& key, int rank, const std::vector<int>& ranks,
                   Clock::time_point deadline) {
  store_all_gather(store, key, rank, ranks, "1", deadline);
}

}  // namespace loom::comm
