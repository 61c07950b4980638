#include "loom/comm/hang_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <map>

#include "loom/comm/flight_recorder.h"
#include "loom/error.h"

namespace loom::comm {

namespace {
struct RankView {
  int rank = -1;
  std::vector<FlightRecord> records;  // this group's, oldest first
};
}  // namespace

std::vector<GroupHang> analyse_hang(const std::vector<nlohmann::json>& dumps) {
  // group id -> its ranks, and each dumping rank's records of it
  std::map<std::string, std::vector<int>> members;
  std::map<std::string, std::vector<RankView>> views;
  for (const auto& d : dumps) {
    try {
      const int rank = d.at("rank").get<int>();
      for (const auto& g : d.at("groups")) {
        const std::string id = g.at("group").get<std::string>();
        members[id] = g.at("ranks").get<std::vector<int>>();
        RankView v{rank, {}};
        for (const auto& r : g.at("records")) v.records.push_back(flight_record_from_json(r));
        views[id].push_back(std::move(v));
      }
    } catch (const nlohmann::json::exception& e) {
      throw CommError(std::string("a flight record file is malformed: ") + e.what());
    }
  }
  std::vector<GroupHang> out;
  for (auto& [id, ranks] : members) {
    auto& vs = views[id];
    // The first collective (by sequence number) that some rank did not complete.
    uint64_t stuck = std::numeric_limits<uint64_t>::max();
    for (const auto& v : vs)
      for (const auto& r : v.records)
        if (r.seq > 0 && r.state != FlightRecord::State::Done) stuck = std::min(stuck, r.seq);
    if (stuck == std::numeric_limits<uint64_t>::max()) continue;
    GroupHang h;
    h.group = id, h.ranks = ranks, h.seq = stuck;
    for (int rank : ranks) {
      const auto v = std::find_if(vs.begin(), vs.end(), [&](const RankView& x) { return x.rank == rank; });
      if (v == vs.end()) {
        h.no_record.push_back(rank);
        h.never_joined.push_back(rank);
        h.last_op.emplace_back();
        continue;
      }
      const auto it = std::find_if(v->records.begin(), v->records.end(), [&](const FlightRecord& r) { return r.seq == stuck; });
      if (it != v->records.end()) {
        if (h.op.empty()) h.op = it->op;
        if (it->state == FlightRecord::State::Done) {
          h.completed.push_back(rank);
        } else {
          h.waited.push_back(rank);
          if (h.error.empty()) h.error = it->error;
        }
        continue;
      }
      h.never_joined.push_back(rank);
      const FlightRecord* last = v->records.empty() ? nullptr : &v->records.back();
      h.last_op.push_back(last ? fmt::format("{} ({})", last->op, flight_state_name(last->state)) : std::string("no op at all"));
    }
    out.push_back(std::move(h));
  }
  return out;
}

std::string format_hang(const std::vector<GroupHang>& hangs) {
  if (hangs.empty()) return "every collective in the flight records completed: the failure was not a hang\n";
  std::string out;
  for (const auto& h : hangs) {
    const std::string what = h.op.empty() ? fmt::format("collective #{} (no rank recorded what it was)", h.seq) : h.op;
    out += fmt::format("group {} (ranks {}): {} did not complete\n", h.group, fmt::join(h.ranks, ", "), what);
    if (!h.waited.empty())
      out += fmt::format("  entered it and waited: rank(s) {}{}\n", fmt::join(h.waited, ", "),
                         h.error.empty() ? "" : " (" + h.error + ")");
    if (!h.completed.empty()) out += fmt::format("  completed it: rank(s) {}\n", fmt::join(h.completed, ", "));
    for (size_t i = 0; i < h.never_joined.size(); ++i) {
      const int r = h.never_joined[i];
      const bool silent = std::find(h.no_record.begin(), h.no_record.end(), r) != h.no_record.end();
      out += fmt::format("  never joined: rank {} ({})\n", r,
                         silent ? "it left no flight record: it was stopped, stuck outside the collectives, before it "
                                  "could write one"
                                : "its last op: " + h.last_op[i]);
    }
  }
  const auto& first = hangs.front();
  if (!first.never_joined.empty())
    out += fmt::format("the hang: rank(s) {} never joined {} of group {}\n", fmt::join(first.never_joined, ", "),
                       first.op.empty() ? fmt::format("collective #{}", first.seq) : first.op, first.group);
  return out;
}

}  // namespace loom::comm
