#include "loom/comm/process_group.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <map>
#include <numeric>
#include <utility>

#include "loom/comm/dispatch.h"
#include "loom/comm/reduce_kernels.h"
#include "loom/comm/world.h"
#include "loom/error.h"

namespace loom::comm {

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  Algo algo = Algo::kAuto;
  const char* group = nullptr;  // the group's id (outlives the op)
  int64_t seq = -1;
  int peer = -1;
};

void Work::wait() {
  if (!state_) return;
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

const char* Work::group() const { return state_ ? state_->group : nullptr; }
int64_t Work::seq() const { return state_ ? state_->seq : -1; }
int Work::peer() const { return state_ ? state_->peer : -1; }

void mark_wait(const Work& w) {
  profile::SpanContext& c = profile::span_context();
  c.group = w.group(), c.seq = w.seq(), c.peer = w.peer();
}

void mark_wait(const ProcessGroup& g) {
  profile::SpanContext& c = profile::span_context();
  c.group = g.id().c_str(), c.seq = -1, c.peer = -1;
}

bool Work::test() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

Algo Work::algorithm() const {
  if (!state_) return Algo::kAuto;
  std::lock_guard lock(state_->mu);
  return state_->algo;
}

RegisteredBuffer::~RegisteredBuffer() {
  if (release_) release_(bytes_);
}
RegisteredBuffer::RegisteredBuffer(RegisteredBuffer&& o) noexcept
    : release_(std::exchange(o.release_, nullptr)), bytes_(std::exchange(o.bytes_, {})) {}
RegisteredBuffer& RegisteredBuffer::operator=(RegisteredBuffer&& o) noexcept {
  if (this != &o) {
    if (release_) release_(bytes_);
    release_ = std::exchange(o.release_, nullptr);
    bytes_ = std::exchange(o.bytes_, {});
  }
  return *this;
}

struct ProcessGroup::Op {
  OpDesc desc;
  CollArgs args;
  std::vector<size_t> counts, recv_counts;  // owned copies for the v-ops
  std::vector<PeerOp> peer_ops;            // send_recv_many's list
  int peer = -1;
  uint64_t tag = 0;
  size_t bytes = 0;  // payload, for the inline decision and statistics
  std::optional<std::chrono::milliseconds> timeout;  // this op's deadline instead of the group's
  std::shared_ptr<Work::State> state;
  uint64_t flight = 0;  // its flight record
};

namespace {
size_t flight_capacity() {
  const char* v = std::getenv("LOOM_COMM_FLIGHT_RECORDS");
  if (!v || !*v) return 256;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > (1 << 20))
    throw ConfigError(fmt::format("LOOM_COMM_FLIGHT_RECORDS = '{}' is not a record count in [0, 1048576] (0: off)", v));
  return static_cast<size_t>(n);
}
}  // namespace

namespace {
// A thread's CPU clock is a system call here (~1.3 us on this VM, more than a small all_reduce), so it is
// read only when statistics are asked for, never per op.
double thread_cpu_seconds(std::thread& t) {
  clockid_t id;
  timespec ts{};
  if (!t.joinable() || pthread_getcpuclockid(t.native_handle(), &id) != 0 || clock_gettime(id, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}
bool is_collective(OpKind k) { return k != OpKind::kSend && k != OpKind::kRecv && k != OpKind::kSendRecvMany; }
}  // namespace

ProcessGroup::ProcessGroup(std::shared_ptr<GroupContext> ctx, std::vector<int> ranks, int rank,
                           std::unique_ptr<Transport> transport, std::string id, Allocator* accounting)
    : ctx_(std::move(ctx)), ranks_(std::move(ranks)), rank_(rank), transport_(std::move(transport)), id_(std::move(id)),
      accounting_(accounting), flight_(flight_capacity()) {
  if (ctx_) tuning_ = ctx_->tuning;
  if (const char* f = std::getenv("LOOM_FAULT_INJECT")) {
    unsigned long long seq = 0;
    int rank = -1;
    if (std::sscanf(f, "hang_before_collective:%d:%llu", &rank, &seq) == 2) hang_rank_ = rank, hang_seq_ = seq;
  }
  thread_ = std::thread([this] { progress_loop(); });
}

ProcessGroup::~ProcessGroup() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

const char* ProcessGroup::transport_name() const { return local_ ? "shm+mpi" : transport_->name(); }

size_t ProcessGroup::buffered_message_bytes() const { return local_ ? 0 : transport_->buffered_message_bytes(); }

void ProcessGroup::set_hierarchy(std::unique_ptr<Transport> local, std::unique_ptr<Transport> cross) {
  local_ = std::move(local);
  cross_ = std::move(cross);
}

GroupStats ProcessGroup::stats() const {
  std::lock_guard lock(mu_);
  GroupStats s = stats_;
  s.comm_cpu_seconds += thread_cpu_seconds(const_cast<std::thread&>(thread_));
  s.bytes_sent = transport_->bytes_sent() + (local_ ? local_->bytes_sent() : 0);
  s.inter_node_bytes = cross_ ? cross_->bytes_sent() : 0;
  return s;
}

RegisteredBuffer ProcessGroup::register_buffer(size_t bytes, MemCategory category) {
  auto block = transport_->arena_allocate(bytes);
  if (!block)
    throw CommError(fmt::format("rank {}: cannot register {:.1f} MiB of communication memory: group {}'s arena is full "
                                "(raise LOOM_COMM_ARENA_MB; an MPI group's arena stops at 256 MiB)",
                                ranks_[rank_], bytes / 1048576.0, id_));
  if (accounting_) accounting_->note_external(category, static_cast<ptrdiff_t>(bytes));
  RegisteredBuffer b;
  b.bytes_ = *block;
  b.release_ = [this, category](std::span<std::byte> blk) {
    transport_->arena_free(blk);
    if (accounting_) accounting_->note_external(category, -static_cast<ptrdiff_t>(blk.size()));
  };
  return b;
}

// A hierarchical group's local and cross transports number peers their own way: local index j is group
// rank node*L + j, cross index j (a node) is group rank j*L + local rank.
int ProcessGroup::group_rank(const Transport* source, int r) const {
  if (local_ && source == local_.get()) return cross_->rank() * local_->size() + r;
  if (cross_ && source == cross_.get()) return r * local_->size() + local_->rank();
  return r;
}

std::string ProcessGroup::label(const Op& op) const {
  if (op.desc.kind == OpKind::kSendRecvMany) {
    std::string peers;
    for (const auto& p : op.peer_ops)
      peers += fmt::format("{}{} {} {} elements (tag {})", peers.empty() ? "" : ", ", p.send ? "send to" : "recv from",
                           ranks_[p.peer], p.count, p.tag);
    return fmt::format("send_recv_many({})", peers);
  }
  if (!is_collective(op.desc.kind))
    return fmt::format("{}({}, {} elements, tag {}) {} rank {}", op_name(op.desc.kind), dtype_name(op.desc.dtype),
                       op.desc.count, op.tag, op.desc.kind == OpKind::kSend ? "to" : "from", ranks_[op.peer]);
  return describe(op.desc);
}

Work ProcessGroup::submit(std::unique_ptr<Op> op) {
  op->state = std::make_shared<Work::State>();
  Work work(op->state);
  std::unique_lock lock(mu_);
  if (is_collective(op->desc.kind)) op->desc.seq = ++next_seq_;
  if (hang_rank_ == ranks_[rank_] && op->desc.seq == hang_seq_ && is_collective(op->desc.kind)) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::hours(1));  // the launcher or the peers' timeout ends the job
  }
  const int first_peer = op->desc.kind == OpKind::kSendRecvMany ? (op->peer_ops.empty() ? -1 : op->peer_ops.front().peer)
                                                                 : op->peer;
  op->flight = flight_.add(op->desc, first_peer >= 0 ? ranks_[first_peer] : -1, op->tag, op->bytes);
  op->state->group = id_.c_str();
  op->state->seq = is_collective(op->desc.kind) ? static_cast<int64_t>(op->desc.seq) : -1;
  op->state->peer = is_collective(op->desc.kind) || first_peer < 0 ? -1 : ranks_[first_peer];
  // Latency: a small op with nothing ahead of it runs here instead of paying a thread hand-off.
  if (queue_.empty() && !busy_ && op->bytes <= tuning_.inline_max_bytes) {
    busy_ = true;
    lock.unlock();
    const auto t0 = Clock::now();
    execute(*op);
    // Inline ops count their wall time as CPU: the caller spins or computes through them (a futex
    // sleep inside is counted too, so this errs high).
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    lock.lock();
    stats_.comm_cpu_seconds += wall;
    busy_ = false;
    // Wake the progress thread only when it has work: a wake-up per inline op costs a context switch.
    const bool queued = !queue_.empty();
    lock.unlock();
    if (queued) cv_.notify_all();
    return work;
  }
  queue_.push_back(std::move(op));
  lock.unlock();
  cv_.notify_all();
  return work;
}

void ProcessGroup::progress_loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || (!queue_.empty() && !busy_); });
    if (queue_.empty()) {
      if (stopping_) return;
      continue;
    }
    auto op = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    execute(*op);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

void ProcessGroup::execute(Op& op) {
  std::exception_ptr error;
  Algo algo = Algo::kAuto;
  std::string broken;
  {
    std::lock_guard lock(mu_);
    broken = broken_;
  }
  const auto deadline = Clock::now() + op.timeout.value_or(tuning_.timeout);
  // Collectives stamp every record and message with their descriptor (seq 0: unchecked), so a rank in
  // another op is named at the first contact.
  OpDesc stamp = op.desc;
  if (!tuning_.check || !is_collective(op.desc.kind)) stamp.seq = 0;
  for (Transport* t : {transport_.get(), local_.get(), cross_.get()})
    if (t) t->set_deadline(deadline), t->set_stamp(stamp);
  // The op's error, and the group's first failure: later ops fail at once instead of hanging.
  flight_.started(op.flight);
  std::string failure;
  auto fail = [&](const auto& e) {  // by its own type: a timeout stays a CommTimeoutError
    error = std::make_exception_ptr(e);
    failure = e.what();
    std::lock_guard lock(mu_);
    if (broken_.empty()) broken_ = e.what();
  };
  try {
    if (!broken.empty())
      throw CommError(fmt::format("rank {}: {} not run: group {} failed earlier ({})", ranks_[rank_], label(op), id_,
                                  broken));
    if (tuning_.debug && is_collective(op.desc.kind) && size() > 1) debug_check(op);
    // The work itself, on this thread, as a span: its bytes, group, sequence number and algorithm.
    profile::SpanContext& where = profile::span_context();
    const profile::SpanContext saved = where;
    where.group = id_.c_str();
    where.seq = is_collective(op.desc.kind) ? static_cast<int64_t>(op.desc.seq) : -1;
    where.peer = op.state->peer;
    where.algorithm = nullptr;
    {
      profile::Span span(tracer_.load(), op_name(op.desc.kind), profile::Category::CommWork, 0,
                         static_cast<double>(op.bytes));
      try {
        algo = run_algorithm(op);
      } catch (...) {
        where = saved;
        throw;
      }
      where.algorithm = algo_name(algo);
    }
    where = saved;
  } catch (const PeerTimeout& pt) {
    std::vector<int> missing;
    for (int r : pt.missing) missing.push_back(ranks_.at(group_rank(pt.source, r)));
    fail(CommTimeoutError(fmt::format(
        "rank {}: {} timed out after {:.0f} s (LOOM_COMM_TIMEOUT) in group {} (ranks [{}]) waiting for {}: rank(s) {} "
        "never arrived",
        ranks_[rank_], label(op), std::chrono::duration<double>(op.timeout.value_or(tuning_.timeout)).count(), id_,
        fmt::join(ranks_, ", "), pt.waiting_for, fmt::join(missing, ", "))));
  } catch (const OpMismatch& om) {
    fail(CommError(fmt::format("rank {}: ops disagree in group {}: rank {} called {}; this rank called {}", ranks_[rank_],
                               id_, ranks_.at(group_rank(om.source, om.peer)), describe(om.theirs), describe(op.desc))));
  } catch (const PeerGone& pg) {
    fail(CommError(fmt::format(
        "rank {}: {} in group {} (ranks [{}]) cannot complete: rank {} is gone (its process exited) while this rank "
        "waited for {}",
        ranks_[rank_], label(op), id_, fmt::join(ranks_, ", "), pg.global_rank, pg.waiting_for)));
  } catch (const CommError& e) {
    auto msg = std::string(e.what());
    if (msg.rfind("rank ", 0) != 0) msg = fmt::format("rank {}: {} in group {}: {}", ranks_[rank_], label(op), id_, msg);
    fail(CommError(msg));
  } catch (...) {
    error = std::current_exception();
    failure = "an error that is not a communication error";
  }
  flight_.ended(op.flight, failure);
  {
    std::lock_guard lock(mu_);
    ++stats_.ops;
  }
  {
    std::lock_guard lock(op.state->mu);
    op.state->done = true;
    op.state->error = error;
    op.state->algo = algo;
  }
  op.state->cv.notify_all();
}

// The classic hang is one rank calling all_gather while the others call all_reduce. Debug mode makes
// every rank publish its op first and compares: the odd one out is named instead of hanging.
void ProcessGroup::debug_check(const Op& op) {
  auto recs = transport_->exchange({reinterpret_cast<const std::byte*>(&op.desc), sizeof(OpDesc)});
  std::vector<OpDesc> all(recs.size());
  for (size_t r = 0; r < recs.size(); ++r) std::memcpy(&all[r], recs[r].data(), sizeof(OpDesc));
  auto same = [](const OpDesc& a, const OpDesc& b) {
    return a.kind == b.kind && a.dtype == b.dtype && a.reduce == b.reduce && a.root == b.root && a.count == b.count &&
           a.seq == b.seq;
  };
  // The majority is taken as right; with two ranks, the other rank is named.
  int best = 0, best_votes = -1;
  for (size_t i = 0; i < all.size(); ++i) {
    int votes = 0;
    for (const auto& d : all) votes += same(all[i], d);
    if (votes > best_votes || (votes == best_votes && static_cast<int>(i) != rank_ && best == rank_)) {
      best = static_cast<int>(i);
      best_votes = votes;
    }
  }
  std::vector<std::string> odd;
  for (size_t i = 0; i < all.size(); ++i)
    if (!same(all[i], all[best]))
      odd.push_back(fmt::format("rank {} called {}", ranks_[i], describe(all[i])));
  if (!odd.empty())
    throw CommError(fmt::format("rank {}: LOOM_COMM_DEBUG: ops disagree in group {}: {}; rank {} and the others called "
                                "{}",
                                ranks_[rank_], id_, fmt::join(odd, "; "), ranks_[best], describe(all[best])));
}

Algo ProcessGroup::run_algorithm(Op& op) {
  Transport& t = *transport_;
  const CollArgs& a = op.args;
  const OpKind k = op.desc.kind;
  switch (k) {
    case OpKind::kSend:
      t.send(op.peer, op.tag, {static_cast<const std::byte*>(a.in), op.bytes});
      return Algo::kAuto;
    case OpKind::kRecv:
      t.recv(op.peer, op.tag, {static_cast<std::byte*>(a.out), op.bytes});
      return Algo::kAuto;
    case OpKind::kSendRecvMany: {
      std::vector<Transport::PeerSend> sends;
      std::vector<Transport::PeerRecv> recvs;
      for (const auto& p : op.peer_ops) {
        const size_t bytes = p.count * dtype_size(p.dtype);
        if (p.send)
          sends.push_back({p.peer, p.tag, {static_cast<const std::byte*>(p.data), bytes}});
        else
          recvs.push_back({p.peer, p.tag, {static_cast<std::byte*>(const_cast<void*>(p.data)), bytes}});
      }
      t.send_recv_many(sends, recvs);
      return Algo::kAuto;
    }
    case OpKind::kBarrier:
      t.exchange({});
      return Algo::kOneShot;
    default: break;
  }
  if (local_ && (k == OpKind::kAllReduce || k == OpKind::kReduceScatter || k == OpKind::kAllGather))
    return run_hierarchical(k, a, *local_, *cross_, tuning_);
  return run_collective(t, k, a, tuning_);
}

// ---- the public ops: describe, validate, submit ----

namespace {
void check_root(int root, int n, const char* what) {
  if (root < 0 || root >= n)
    throw CommError(fmt::format("{}: root {} is not a rank of this group of {}", what, root, n));
}
}  // namespace

Work ProcessGroup::all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op) {
  check_reduce(dtype, op);
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kAllReduce, dtype, op, -1, count, 0};
  o->args = {.in = in, .out = out, .count = count, .dtype = dtype, .reduce = op};
  o->bytes = count * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op) {
  check_reduce(dtype, op);
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kReduceScatter, dtype, op, -1, count, 0};
  o->args = {.in = in, .out = out, .count = count, .dtype = dtype, .reduce = op};
  o->bytes = count * dtype_size(dtype) * size();
  return submit(std::move(o));
}

Work ProcessGroup::all_gather(const void* in, void* out, size_t count, DType dtype) {
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kAllGather, dtype, ReduceOp::kSum, -1, count, 0};
  o->counts.assign(size(), count);
  o->args = {.in = in, .out = out, .count = count, .dtype = dtype, .counts = o->counts};
  o->bytes = count * dtype_size(dtype) * size();
  return submit(std::move(o));
}

Work ProcessGroup::all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType dtype) {
  if (static_cast<int>(counts.size()) != size())
    throw CommError(fmt::format("all_gather_v: {} counts given for a group of {}", counts.size(), size()));
  auto o = std::make_unique<Op>();
  o->counts.assign(counts.begin(), counts.end());
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  o->desc = {OpKind::kAllGatherV, dtype, ReduceOp::kSum, -1, total, 0};
  o->args = {.in = in, .out = out, .count = total, .dtype = dtype, .counts = o->counts};
  o->bytes = total * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::broadcast(void* buf, size_t count, DType dtype, int root) {
  check_root(root, size(), "broadcast");
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kBroadcast, dtype, ReduceOp::kSum, root, count, 0};
  o->args = {.in = buf, .out = buf, .count = count, .dtype = dtype, .root = root};
  o->bytes = count * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) {
  check_reduce(dtype, op);
  check_root(root, size(), "reduce");
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kReduce, dtype, op, root, count, 0};
  o->args = {.in = in, .out = out, .count = count, .dtype = dtype, .reduce = op, .root = root};
  o->bytes = count * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::all_to_all(const void* in, void* out, size_t count, DType dtype) {
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kAllToAll, dtype, ReduceOp::kSum, -1, count, 0};
  o->counts.assign(size(), count);
  o->recv_counts.assign(size(), count);
  o->args = {.in = in, .out = out, .count = count, .dtype = dtype, .counts = o->counts, .recv_counts = o->recv_counts};
  o->bytes = count * dtype_size(dtype) * size();
  return submit(std::move(o));
}

Work ProcessGroup::all_to_all_v(const void* in, void* out, std::span<const size_t> send_counts,
                                std::span<const size_t> recv_counts, DType dtype) {
  if (static_cast<int>(send_counts.size()) != size() || static_cast<int>(recv_counts.size()) != size())
    throw CommError(fmt::format("all_to_all_v: {} send and {} receive counts given for a group of {}",
                                send_counts.size(), recv_counts.size(), size()));
  auto o = std::make_unique<Op>();
  o->counts.assign(send_counts.begin(), send_counts.end());
  o->recv_counts.assign(recv_counts.begin(), recv_counts.end());
  // The counts differ per rank, so only kind and dtype can be cross-checked.
  o->desc = {OpKind::kAllToAllV, dtype, ReduceOp::kSum, -1, 0, 0};
  o->args = {.in = in, .out = out, .dtype = dtype, .counts = o->counts, .recv_counts = o->recv_counts};
  o->bytes = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0}) * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::send(const void* buf, size_t count, DType dtype, int peer, uint64_t tag) {
  if (peer < 0 || peer >= size() || peer == rank_)
    throw CommError(fmt::format("send: peer {} is not another rank of this group of {}", peer, size()));
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kSend, dtype, ReduceOp::kSum, -1, count, 0};
  o->args = {.in = buf, .count = count, .dtype = dtype};
  o->peer = peer;
  o->tag = tag;
  o->bytes = count * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::recv(void* buf, size_t count, DType dtype, int peer, uint64_t tag) {
  if (peer < 0 || peer >= size() || peer == rank_)
    throw CommError(fmt::format("recv: peer {} is not another rank of this group of {}", peer, size()));
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kRecv, dtype, ReduceOp::kSum, -1, count, 0};
  o->args = {.out = buf, .count = count, .dtype = dtype};
  o->peer = peer;
  o->tag = tag;
  o->bytes = count * dtype_size(dtype);
  return submit(std::move(o));
}

Work ProcessGroup::send_recv_many(std::span<const PeerOp> ops) {
  auto o = std::make_unique<Op>();
  size_t bytes = 0;
  for (const auto& p : ops) {
    if (p.peer < 0 || p.peer >= size() || p.peer == rank_)
      throw CommError(fmt::format("send_recv_many: peer {} is not another rank of this group of {}", p.peer, size()));
    bytes += p.count * dtype_size(p.dtype);
  }
  o->desc = {OpKind::kSendRecvMany, DType::F32, ReduceOp::kSum, -1, ops.size(), 0};
  o->peer_ops.assign(ops.begin(), ops.end());
  o->bytes = bytes;
  // The first peer names the op in timeouts and errors that report one peer.
  o->peer = ops.empty() ? -1 : ops.front().peer;
  return submit(std::move(o));
}

nlohmann::json ProcessGroup::flight_json() const {
  nlohmann::json records = nlohmann::json::array();
  for (const auto& r : flight_.snapshot()) records.push_back(flight_record_json(r));
  return {{"group", id_}, {"ranks", ranks_}, {"rank", ranks_[rank_]}, {"records", records}};
}

Work ProcessGroup::barrier(std::optional<std::chrono::milliseconds> timeout) {
  auto o = std::make_unique<Op>();
  o->desc = {OpKind::kBarrier, DType::F32, ReduceOp::kSum, -1, 0, 0};
  o->timeout = timeout;
  return submit(std::move(o));
}

std::unique_ptr<ProcessGroup> ProcessGroup::split(int color, int key) {
  int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * size());
  all_gather(mine, all.data(), 2, DType::I32).wait();
  std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, group rank), group rank)
  for (int r = 0; r < size(); ++r)
    if (all[2 * r] == color) members.push_back({{all[2 * r + 1], r}, r});
  const int split_index = ++splits_;
  std::sort(members.begin(), members.end());
  std::vector<int> global;
  int my_index = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    global.push_back(ranks_[members[i].second]);
    if (members[i].second == rank_) my_index = static_cast<int>(i);
  }
  std::string id = fmt::format("{}.s{}c{}", id_, split_index, color);
  // Colors are announced to everyone so an MPI parent can split its communicator collectively.
  return make_subgroup(ctx_, *this, *transport_, color, key, std::move(global), my_index, std::move(id),
                       accounting_);
}

}  // namespace loom::comm
