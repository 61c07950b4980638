// Store-based steps every group takes once, before its transport exists: a barrier that names the
// ranks that never arrived, and an all-gather of small strings (shared-memory names, host names).
#pragma once

#include <string>
#include <vector>

#include "loom/comm/doorbell.h"
#include "loom/comm/store.h"

namespace loom::comm {

// `ranks` are the global ranks of the group (for the message); `rank` indexes into them.
// Throws CommTimeoutError naming the group ranks whose keys never appeared before `deadline`.
std::vector<std::string> store_all_gather(Store& store, const std::string& key, int rank, const std::vector<int>& ranks,
                                          const std::string& value, Clock::time_point deadline);
void store_barrier(Store& store, const std::string& key, int rank, const std::vector<int>& ranks,
                   Clock::time_point deadline);

}  // namespace loom::comm
