// The last ops of a process group, kept so a hang or a failure can be explained afterwards (what NCCL's
// flight recorder keeps): each op's issue order, collective sequence number, description, state and
// times. A job that fails dumps every group's records into its run directory
// (train/session.cpp: flight/rank-R.json), and `loom profile hang RUN_DIR` reads them back to name the
// collective that some ranks never joined.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/comm/collective.h"

namespace loom::comm {

struct FlightRecord {
  enum class State { Queued, Running, Done, Failed };
  uint64_t id = 0;        // issue order on this rank, every op
  uint64_t seq = 0;       // the collective's sequence number in its group (0: point to point)
  std::string op;         // "all_reduce(F32, sum, 64 elements) #3"; described from desc when written
  OpDesc desc{};          // what the op was (kind, dtype, count, ...)
  int peer = -1;          // point to point: the (first) peer's global rank
  uint64_t tag = 0;
  size_t bytes = 0;
  State state = State::Queued;
  double queued = 0, started = 0, ended = 0;  // seconds since the Unix epoch (0: not yet)
  std::string error;      // when Failed
};
const char* flight_state_name(FlightRecord::State s);

class FlightRecorder {
 public:
  // capacity: records kept (the oldest are dropped first); 0 records nothing (to measure what recording
  // costs). LOOM_COMM_FLIGHT_RECORDS sets it per job.
  explicit FlightRecorder(size_t capacity = 256) : capacity_(capacity) {}
  // Records a new op as queued (nothing is formatted on this path: ops are frequent); returns its id.
  uint64_t add(const OpDesc& desc, int peer, uint64_t tag, size_t bytes);
  void started(uint64_t id);
  void ended(uint64_t id, const std::string& error);  // empty error: done
  std::vector<FlightRecord> snapshot() const;          // oldest first
  static double now();

 private:
  FlightRecord* find(uint64_t id);  // nullptr once dropped
  size_t capacity_;
  mutable std::mutex mu_;
  std::vector<FlightRecord> ring_;
  uint64_t next_id_ = 1;
};

// "all_reduce(F32, sum, 64 elements) #3", "send(F32, 8 elements, tag 5) peer rank 1", ...
std::string describe_record(const FlightRecord& r);
nlohmann::json flight_record_json(const FlightRecord& r);
FlightRecord flight_record_from_json(const nlohmann::json& j);  // throws nlohmann::json::exception

}  // namespace loom::comm
