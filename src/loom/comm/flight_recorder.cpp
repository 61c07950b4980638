#include "loom/comm/flight_recorder.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

namespace loom::comm {

const char* flight_state_name(FlightRecord::State s) {
  switch (s) {
    case FlightRecord::State::Queued: return "queued";
    case FlightRecord::State::Running: return "running";
    case FlightRecord::State::Done: return "done";
    case FlightRecord::State::Failed: return "failed";
  }
  return "?";
}

double FlightRecorder::now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

uint64_t FlightRecorder::add(const OpDesc& desc, int peer, uint64_t tag, size_t bytes) {
  if (capacity_ == 0) return 0;
  const double t = now();
  std::lock_guard lock(mu_);
  FlightRecord r;
  r.id = next_id_++;
  r.seq = desc.seq;
  r.desc = desc;
  r.peer = peer;
  r.tag = tag;
  r.bytes = bytes;
  r.queued = t;
  // A ring: record id i lives in slot (i - 1) % capacity once the ring is full.
  if (ring_.size() < capacity_)
    ring_.push_back(std::move(r));
  else
    ring_[(r.id - 1) % capacity_] = std::move(r);
  return next_id_ - 1;
}

FlightRecord* FlightRecorder::find(uint64_t id) {
  if (id == 0 || capacity_ == 0 || id >= next_id_ || next_id_ - id > capacity_) return nullptr;
  FlightRecord& r = ring_[(id - 1) % capacity_];
  return r.id == id ? &r : nullptr;
}

void FlightRecorder::started(uint64_t id) {
  if (id == 0) return;
  std::lock_guard lock(mu_);
  if (auto* r = find(id)) r->state = FlightRecord::State::Running, r->started = now();
}

void FlightRecorder::ended(uint64_t id, const std::string& error) {
  if (id == 0) return;
  std::lock_guard lock(mu_);
  if (auto* r = find(id)) {
    r->state = error.empty() ? FlightRecord::State::Done : FlightRecord::State::Failed;
    r->ended = now();
    r->error = error;
  }
}

std::vector<FlightRecord> FlightRecorder::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<FlightRecord> out = ring_;
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

std::string describe_record(const FlightRecord& r) {
  if (!r.op.empty()) return r.op;
  switch (r.desc.kind) {
    case OpKind::kSend:
    case OpKind::kRecv:
      return fmt::format("{}({}, {} elements, tag {}) {} rank {}", op_name(r.desc.kind), dtype_name(r.desc.dtype),
                         r.desc.count, r.tag, r.desc.kind == OpKind::kSend ? "to" : "from", r.peer);
    case OpKind::kSendRecvMany:
      return fmt::format("send_recv_many({} sends and receives, first with rank {})", r.desc.count, r.peer);
    default: return describe(r.desc);
  }
}

nlohmann::json flight_record_json(const FlightRecord& r) {
  nlohmann::json j{{"id", r.id},         {"seq", r.seq},         {"op", describe_record(r)},   {"bytes", r.bytes},
                   {"state", flight_state_name(r.state)}, {"queued", r.queued}, {"started", r.started},
                   {"ended", r.ended}};
  if (!r.error.empty()) j["error"] = r.error;
  return j;
}

FlightRecord flight_record_from_json(const nlohmann::json& j) {
  FlightRecord r;
  r.id = j.at("id").get<uint64_t>();
  r.seq = j.at("seq").get<uint64_t>();
  r.op = j.at("op").get<std::string>();
  r.bytes = j.value("bytes", size_t{0});
  const std::string state = j.at("state").get<std::string>();
  for (auto s : {FlightRecord::State::Queued, FlightRecord::State::Running, FlightRecord::State::Done,
                 FlightRecord::State::Failed})
    if (state == flight_state_name(s)) r.state = s;
  r.queued = j.value("queued", 0.0), r.started = j.value("started", 0.0), r.ended = j.value("ended", 0.0);
  r.error = j.value("error", std::string());
  return r;
}

}  // namespace loom::comm
