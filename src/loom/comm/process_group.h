// A group of ranks that runs collectives: every op returns a Work, ops run in issue order on the
// group's own progress thread (so computation overlaps communication), and a small op issued while the
// queue is empty runs inline in the caller. Results are bitwise identical on every rank.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "loom/comm/algorithms.h"
#include "loom/comm/collective.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/transport.h"
#include "loom/core/allocator.h"
#include "loom/profile/tracer.h"

namespace loom::comm {

class Store;
class ProcessGroup;
struct GroupContext;  // job-wide: store, options, node map (world.cpp)

// Handle of one issued op. wait() rethrows the op's error (CommError / CommTimeoutError).
class Work {
 public:
  struct State;
  Work() = default;
  explicit Work(std::shared_ptr<State> s) : state_(std::move(s)) {}
  void wait();
  bool test() const;  // finished (successfully or not)?
  Algo algorithm() const;  // what ran (after completion)
  // The op's group id, its sequence number there (collectives; -1 otherwise) and its first peer's
  // global rank (point to point; -1 otherwise). nullptr / -1 for an empty handle.
  const char* group() const;
  int64_t seq() const;
  int peer() const;

 private:
  std::shared_ptr<State> state_;
};

// Marks the spans this thread records next (the training thread's wait for `w`) with the op's group,
// sequence number and peer, as the progress thread marks the op's own span: the report then matches a
// wait to its collective across ranks. Restore the context after the span is recorded (a
// profile::ScopedSpanContext around it).
void mark_wait(const Work& w);
// The same for a wait on several ops of one group (gradient buckets): the group alone.
void mark_wait(const ProcessGroup& g);
// Issues an op (`issue` returns its Work) and waits for it under one Communication span named `name`
// that names the op: the span starts before the issue, since a small op runs inline there.
template <class Issue>
void issue_and_wait(profile::Tracer* tracer, const char* name, double bytes, Issue&& issue) {
  const profile::ScopedSpanContext restore(profile::SpanContext::kNoUnit);  // the mark ends after the span
  profile::Span span(tracer, name, profile::Category::Communication, 0, bytes);
  Work w = issue();
  mark_wait(w);
  w.wait();
}

// Memory in the group's shared arena: collectives on it read peers' copies in place. Counted as
// communication buffers by the allocator given at group creation. Must not outlive its group.
class RegisteredBuffer {
 public:
  RegisteredBuffer() = default;
  ~RegisteredBuffer();
  RegisteredBuffer(RegisteredBuffer&& o) noexcept;
  RegisteredBuffer& operator=(RegisteredBuffer&& o) noexcept;
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  std::byte* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }
  template <class T>
  T* as() const { return reinterpret_cast<T*>(bytes_.data()); }

 private:
  friend class ProcessGroup;
  std::function<void(std::span<std::byte>)> release_;
  std::span<std::byte> bytes_;
};

struct GroupStats {
  uint64_t ops = 0;
  double comm_cpu_seconds = 0;  // CPU time spent executing ops (progress thread and inline)
  uint64_t bytes_sent = 0;      // through the flat transport
  uint64_t inter_node_bytes = 0;  // through the inter-node transport of a hierarchical group
};

class ProcessGroup {
 public:
  // `transport` carries every op; a hierarchical group also has a node-local and an inter-node
  // transport for all_reduce / reduce_scatter / all_gather (see world.cpp).
  ProcessGroup(std::shared_ptr<GroupContext> ctx, std::vector<int> ranks, int rank, std::unique_ptr<Transport> transport,
               std::string id, Allocator* accounting);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }  // global ranks, by group rank
  const std::string& id() const { return id_; }
  const char* transport_name() const;
  // Bytes of one point-to-point message a send hands over without waiting for its receiver
  // (Transport::buffered_message_bytes; 0 across nodes).
  size_t buffered_message_bytes() const;
  Tuning& tuning() { return tuning_; }

  Work all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op = ReduceOp::kSum);
  // in: size()*count elements, block j reduced into rank j's out (count elements).
  Work reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op = ReduceOp::kSum);
  // in: count elements; out: size()*count. In place when in == out + rank()*count.
  Work all_gather(const void* in, void* out, size_t count, DType dtype);
  Work all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType dtype);
  Work broadcast(void* buf, size_t count, DType dtype, int root);
  Work reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root);
  // in/out: size()*count elements; block j of in goes to rank j, block j of out came from rank j.
  Work all_to_all(const void* in, void* out, size_t count, DType dtype);
  Work all_to_all_v(const void* in, void* out, std::span<const size_t> send_counts,
                    std::span<const size_t> recv_counts, DType dtype);
  Work send(const void* buf, size_t count, DType dtype, int peer, uint64_t tag);
  Work recv(void* buf, size_t count, DType dtype, int peer, uint64_t tag);
  // Grouped point to point (torch's batch_isend_irecv): every send and receive of the list in progress
  // at once, so two neighbours exchanging in both directions never deadlock whatever the message size.
  // Messages to (from) one peer go in list order. Buffers must stay valid until the Work completes.
  struct PeerOp {
    bool send = true;
    const void* data = nullptr;  // the buffer (written into for a receive)
    size_t count = 0;
    DType dtype = DType::F32;
    int peer = -1;
    uint64_t tag = 0;
  };
  Work send_recv_many(std::span<const PeerOp> ops);
  // `timeout` replaces the group's LOOM_COMM_TIMEOUT for this barrier (a wait for a peer's I/O).
  Work barrier(std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  // Collective over this group: ranks with the same color form a new group, ordered by (key, rank).
  // A negative color joins no group and gets nullptr.
  std::unique_ptr<ProcessGroup> split(int color, int key);

  // Throws CommError when the arena cannot hold `bytes` (LOOM_COMM_ARENA_MB sets its size). The bytes
  // are accounted under `category` (a gradient arena placed here is still gradients).
  RegisteredBuffer register_buffer(size_t bytes, MemCategory category = MemCategory::Communication);

  GroupStats stats() const;
  // Where the progress thread records each op it runs (a CommWork span with the op's bytes, group,
  // sequence number and algorithm); nullptr: nowhere. Set before ops are issued, cleared before the
  // tracer goes.
  void set_tracer(profile::Tracer* tracer) { tracer_.store(tracer); }
  // The group's last ops (comm/flight_recorder.h) as JSON: {"group", "ranks", "rank", "records"}.
  nlohmann::json flight_json() const;

  // Hierarchical parts (set up by world.cpp when the group spans nodes).
  void set_hierarchy(std::unique_ptr<Transport> local, std::unique_ptr<Transport> cross);

 private:
  struct Op;
  Work submit(std::unique_ptr<Op> op);
  void progress_loop();
  void execute(Op& op);
  Algo run_algorithm(Op& op);
  void debug_check(const Op& op);
  std::string label(const Op& op) const;
  // The group rank of rank `r` of `source` (the flat transport, or a hierarchical group's parts).
  int group_rank(const Transport* source, int r) const;

  std::shared_ptr<GroupContext> ctx_;
  std::vector<int> ranks_;
  int rank_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Transport> local_, cross_;  // hierarchical groups only
  std::string id_;
  Allocator* accounting_;
  Tuning tuning_;
  int splits_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  uint64_t next_seq_ = 0;
  std::string broken_;  // the first failure: later ops fail at once instead of hanging
  GroupStats stats_;
  FlightRecorder flight_;
  std::atomic<profile::Tracer*> tracer_{nullptr};
  // Test-only fault (LOOM_FAULT_INJECT=hang_before_collective:RANK:SEQ): global rank RANK stops before
  // issuing its collective number SEQ in any group, as a rank stuck outside the collectives would.
  int hang_rank_ = -1;
  uint64_t hang_seq_ = 0;
  std::thread thread_;
};

}  // namespace loom::comm
