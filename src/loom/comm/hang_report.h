// `loom profile hang RUN_DIR`: from the flight records every rank of a failed job dumped
// (flight_recorder.h; train/session.cpp writes RUN_DIR/flight/rank-R.json), the collective each group
// did not complete, which ranks entered it and waited, and which never joined (with what they did last).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom::comm {

struct GroupHang {
  std::string group;
  std::vector<int> ranks;      // the group's global ranks
  uint64_t seq = 0;            // the first collective some rank did not complete
  std::string op;              // its description
  std::vector<int> waited;     // entered it and did not complete it
  std::vector<int> completed;  // completed it (a one-sided algorithm may let some finish)
  std::vector<int> never_joined;
  std::vector<std::string> last_op;  // per never-joined rank: its last op ("" when it left no record)
  std::vector<int> no_record;  // ranks of the group that dumped nothing
  std::string error;           // a waiting rank's failure, for the reason
};

// dumps: the parsed rank-R.json files. Groups whose collectives all completed are left out. Throws
// CommError naming the problem when a dump is not a flight record.
std::vector<GroupHang> analyse_hang(const std::vector<nlohmann::json>& dumps);
std::string format_hang(const std::vector<GroupHang>& hangs);

}  // namespace loom::comm
