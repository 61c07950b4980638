#include "loom/comm/shm_transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "loom/comm/rendezvous.h"
#include "loom/error.h"

namespace loom::comm {

namespace {
constexpr uint64_t kMagic = 0x4c4f4f4d53484d31ull;  // "LOOMSHM1"
constexpr size_t kLine = 64;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct alignas(kLine) Arrival {
  std::atomic<uint64_t> seq;  // exchanges this rank has entered
  uint32_t bytes[2];          // record size per slot parity
  OpDesc stamp[2];            // the op that made the record, per slot parity
};

struct alignas(kLine) Counter {
  std::atomic<uint64_t> value;
};

struct ChunkHeader {
  uint64_t tag;
  uint64_t msg_bytes;
  OpDesc stamp;  // the sender's op
};
}  // namespace

// Where everything lives in the control segment (sizes in bytes, all cache-line aligned):
//   header | doorbells[n] | arrivals[n] | slots[n][2][exchange_bytes]
//   | heads[n*n] | tails[n*n] | chunks[n*n][K][64 + chunk_bytes]
// Channel (s -> d) is index s*n + d: only s advances its head, only d its tail (single producer,
// single consumer), so neither needs a lock.
struct ShmTransport::Layout {
  int n;
  size_t slot_bytes, chunk_stride;
  int k;
  std::byte* base;
  Doorbell* bells;
  Arrival* arrivals;
  std::byte* slots;
  Counter* heads;
  Counter* tails;
  std::byte* chunks;
  size_t total;

  Layout(int n_, const ShmOptions& o, std::byte* base_) : n(n_), slot_bytes(round_up(o.exchange_bytes, kLine)),
        chunk_stride(round_up(sizeof(ChunkHeader), kLine) + round_up(o.chunk_bytes, kLine)), k(o.chunks_per_channel),
        base(base_) {
    size_t off = kLine;
    auto take = [&](size_t bytes) {
      size_t at = off;
      off += round_up(bytes, kLine);
      return at;
    };
    size_t bells_at = take(sizeof(Doorbell) * n);
    size_t arrivals_at = take(sizeof(Arrival) * n);
    size_t slots_at = take(slot_bytes * 2 * n);
    size_t heads_at = take(sizeof(Counter) * n * n);
    size_t tails_at = take(sizeof(Counter) * n * n);
    size_t chunks_at = take(chunk_stride * k * n * n);
    total = off;
    bells = reinterpret_cast<Doorbell*>(base + bells_at);
    arrivals = reinterpret_cast<Arrival*>(base + arrivals_at);
    slots = base + slots_at;
    heads = reinterpret_cast<Counter*>(base + heads_at);
    tails = reinterpret_cast<Counter*>(base + tails_at);
    chunks = base + chunks_at;
  }
  std::byte* slot(int rank, int parity) const { return slots + (static_cast<size_t>(rank) * 2 + parity) * slot_bytes; }
  int channel(int from, int to) const { return from * n + to; }
  std::byte* chunk(int ch, uint64_t index) const {
    return chunks + (static_cast<size_t>(ch) * k + index % k) * chunk_stride;
  }
  size_t chunk_payload() const { return chunk_stride - round_up(sizeof(ChunkHeader), kLine); }
};

struct ShmTransport::Message {
  int peer;
  uint64_t tag;
  const std::byte* out;  // send side
  std::byte* in;         // receive side
  size_t bytes;
  size_t chunks_total;
  size_t chunks_done = 0;
  bool done() const { return chunks_done == chunks_total; }
};

ShmTransport::ShmTransport(int rank, int size, const ShmOptions& options) : Transport(rank, size), options_(options) {
  spin_ = spin_policy_for(options.ranks_on_node > 0 ? options.ranks_on_node : size,
                          std::chrono::microseconds(options.spin_us));
}

ShmTransport::~ShmTransport() = default;

std::unique_ptr<ShmTransport> ShmTransport::create(Store& store, const std::string& key, const std::string& shm_prefix,
                                                   int rank, const std::vector<int>& ranks, const ShmOptions& options,
                                                   Clock::time_point deadline,
                                                   std::shared_ptr<const PeerLiveness> liveness) {
  const int n = static_cast<int>(ranks.size());
  std::unique_ptr<ShmTransport> t(new ShmTransport(rank, n, options));
  t->global_ranks_ = ranks;
  t->liveness_ = std::move(liveness);
  Layout probe(n, options, nullptr);
  const std::string control_name = shm_prefix + "-ctl";
  auto arena_name = [&](int r) { return fmt::format("{}-a{}", shm_prefix, r); };

  if (rank == 0) {
    t->control_ = ShmSegment::create(control_name, probe.total);
    uint64_t magic = kMagic;
    std::memcpy(t->control_.data(), &magic, sizeof magic);  // fresh tmpfs pages are zero: all counters start at 0
  }
  t->own_arena_ = ShmSegment::create(arena_name(rank), options.arena_bytes);
  t->arena_free_.reset(options.arena_bytes);
  store_barrier(store, key + "/created", rank, ranks, deadline);

  if (rank != 0) t->control_ = ShmSegment::open(control_name, probe.total);
  uint64_t magic = 0;
  std::memcpy(&magic, t->control_.data(), sizeof magic);
  if (magic != kMagic) throw CommError("shared memory " + control_name + " is not a Loom control segment");
  t->peer_arenas_.resize(n);
  for (int r = 0; r < n; ++r)
    if (r != rank) t->peer_arenas_[r] = ShmSegment::open(arena_name(r), options.arena_bytes);
  // Everyone has mapped everything: drop the names now, so no crash from here on can leave any behind.
  store_barrier(store, key + "/mapped", rank, ranks, deadline);
  t->control_.unlink();
  t->own_arena_.unlink();
  t->layout_ = std::make_unique<Layout>(n, options, t->control_.data());
  return t;
}

void ShmTransport::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= size_ || peer == rank_)
    throw CommError(fmt::format("{}: peer {} is not another rank of this group of {}", what, peer, size_));
}

void ShmTransport::check_peers_alive(const char* waiting_for) const {
  if (!liveness_) return;
  if (auto gone = liveness_->first_gone(global_ranks_)) throw PeerGone{*gone, waiting_for};
}

void ShmTransport::wait_for(const char* what, int peer, const std::function<bool()>& ready) {
  if (!wait_on(layout_->bells[rank_], spin_, deadline_, ready, [&] { check_peers_alive(what); }))
    throw PeerTimeout{{peer}, what, this};
}

std::vector<std::span<const std::byte>> ShmTransport::exchange(std::span<const std::byte> mine) {
  Layout& L = *layout_;
  if (mine.size() > L.slot_bytes)
    throw CommError(fmt::format("exchange of {} bytes exceeds the {}-byte record", mine.size(), L.slot_bytes));
  const uint64_t k = ++exchanges_;
  const int parity = static_cast<int>(k & 1);
  // Slot parity k%2 was last used by exchange k-2; a peer that entered exchange k-1 is done reading it.
  auto all_reached = [&](uint64_t target, std::vector<int>* missing) {
    bool ok = true;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && L.arrivals[r].seq.load(std::memory_order_acquire) < target) {
        ok = false;
        if (missing) missing->push_back(r);
        else return false;
      }
    }
    return ok;
  };
  auto wait_all = [&](uint64_t target) {
    if (!wait_on(L.bells[rank_], spin_, deadline_, [&] { return all_reached(target, nullptr); },
                 [&] { check_peers_alive("exchange"); })) {
      PeerTimeout pt{{}, "exchange", this};
      all_reached(target, &pt.missing);
      throw pt;
    }
  };
  if (k >= 2) wait_all(k - 1);
  if (!mine.empty()) std::memcpy(L.slot(rank_, parity), mine.data(), mine.size());
  L.arrivals[rank_].bytes[parity] = static_cast<uint32_t>(mine.size());
  L.arrivals[rank_].stamp[parity] = stamp_;
  L.arrivals[rank_].seq.store(k, std::memory_order_seq_cst);
  for (int r = 0; r < size_; ++r)
    if (r != rank_) ring(L.bells[r]);
  bytes_sent_ += mine.size();
  wait_all(k);
  for (int r = 0; r < size_; ++r)
    if (r != rank_) check_stamp(r, L.arrivals[r].stamp[parity]);
  std::vector<std::span<const std::byte>> views(size_);
  for (int r = 0; r < size_; ++r) views[r] = {L.slot(r, parity), L.arrivals[r].bytes[parity]};
  return views;
}

bool ShmTransport::try_push(Message& m) {
  Layout& L = *layout_;
  const int ch = L.channel(rank_, m.peer);
  uint64_t head = L.heads[ch].value.load(std::memory_order_relaxed);
  if (head - L.tails[ch].value.load(std::memory_order_acquire) >= static_cast<uint64_t>(L.k)) return false;
  std::byte* slot = L.chunk(ch, head);
  const size_t payload = L.chunk_payload();
  const size_t off = m.chunks_done * payload;
  const size_t len = std::min(payload, m.bytes - std::min(m.bytes, off));
  ChunkHeader h{m.tag, m.bytes, stamp_};
  std::memcpy(slot, &h, sizeof h);
  if (len) std::memcpy(slot + round_up(sizeof(ChunkHeader), kLine), m.out + off, len);
  L.heads[ch].value.store(head + 1, std::memory_order_seq_cst);
  ring(L.bells[m.peer]);
  bytes_sent_ += len;
  ++m.chunks_done;
  return true;
}

bool ShmTransport::try_pull(Message& m) {
  Layout& L = *layout_;
  const int ch = L.channel(m.peer, rank_);
  uint64_t tail = L.tails[ch].value.load(std::memory_order_relaxed);
  if (L.heads[ch].value.load(std::memory_order_acquire) == tail) return false;
  const std::byte* slot = L.chunk(ch, tail);
  ChunkHeader h;
  std::memcpy(&h, slot, sizeof h);
  check_stamp(m.peer, h.stamp);
  if (h.tag != m.tag || h.msg_bytes != m.bytes)
    throw CommError(fmt::format(
        "group rank {} expected a message with tag {} of {} bytes from group rank {}, but the next one has tag {} "
        "and {} bytes (send and recv calls do not match)",
        rank_, m.tag, m.bytes, m.peer, h.tag, h.msg_bytes));
  const size_t payload = L.chunk_payload();
  const size_t off = m.chunks_done * payload;
  const size_t len = std::min(payload, m.bytes - std::min(m.bytes, off));
  if (len) std::memcpy(m.in + off, slot + round_up(sizeof(ChunkHeader), kLine), len);
  L.tails[ch].value.store(tail + 1, std::memory_order_seq_cst);
  ring(L.bells[m.peer]);
  ++m.chunks_done;
  return true;
}

void ShmTransport::send(int peer, uint64_t tag, std::span<const std::byte> data) {
  check_peer(peer, "send");
  const size_t payload = layout_->chunk_payload();
  Message m{peer, tag, data.data(), nullptr, data.size(), std::max<size_t>(1, (data.size() + payload - 1) / payload)};
  while (!m.done()) {
    if (!try_push(m)) wait_for("room in the channel to the peer", peer, [&] { return try_push(m); });
  }
}

void ShmTransport::recv(int peer, uint64_t tag, std::span<std::byte> data) {
  check_peer(peer, "recv");
  const size_t payload = layout_->chunk_payload();
  Message m{peer, tag, nullptr, data.data(), data.size(), std::max<size_t>(1, (data.size() + payload - 1) / payload)};
  while (!m.done()) {
    if (!try_pull(m)) wait_for("a message from the peer", peer, [&] { return try_pull(m); });
  }
}

void ShmTransport::send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in) {
  check_peer(to, "send_recv");
  check_peer(from, "send_recv");
  const size_t payload = layout_->chunk_payload();
  auto chunks = [&](size_t bytes) { return std::max<size_t>(1, (bytes + payload - 1) / payload); };
  Message s{to, 0, out.data(), nullptr, out.size(), chunks(out.size())};
  Message r{from, 0, nullptr, in.data(), in.size(), chunks(in.size())};
  // Alternate pushing and pulling: with bounded channels, a ring of ranks that each sent everything
  // before receiving would deadlock as soon as a message exceeds the channel.
  auto step = [&] {
    bool moved = false;
    if (!s.done()) moved |= try_push(s);
    if (!r.done()) moved |= try_pull(r);
    return moved;
  };
  while (!s.done() || !r.done()) {
    if (!step()) wait_for(s.done() ? "a message from the peer" : "the peers of a ring step", s.done() ? from : to, step);
  }
}

void ShmTransport::send_recv_many(std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) {
  const size_t payload = layout_->chunk_payload();
  auto chunks = [&](size_t bytes) { return std::max<size_t>(1, (bytes + payload - 1) / payload); };
  std::vector<Message> out, in;
  for (const auto& m : sends) {
    check_peer(m.peer, "send_recv_many");
    out.push_back({m.peer, m.tag, m.data.data(), nullptr, m.data.size(), chunks(m.data.size())});
  }
  for (const auto& m : recvs) {
    check_peer(m.peer, "send_recv_many");
    in.push_back({m.peer, m.tag, nullptr, m.data.data(), m.data.size(), chunks(m.data.size())});
  }
  // Every message moves a chunk whenever its channel allows, except that a channel carries one message
  // at a time, in list order: only the first unfinished message per peer and direction is active.
  auto step = [&] {
    bool moved = false;
    std::vector<char> busy_out(static_cast<size_t>(size_), 0), busy_in(static_cast<size_t>(size_), 0);
    for (auto& m : out) {
      if (m.done() || busy_out[static_cast<size_t>(m.peer)]) continue;
      busy_out[static_cast<size_t>(m.peer)] = 1;
      while (!m.done() && try_push(m)) moved = true;
      if (!m.done()) continue;
      busy_out[static_cast<size_t>(m.peer)] = 0;  // the next message to this peer may start next round
    }
    for (auto& m : in) {
      if (m.done() || busy_in[static_cast<size_t>(m.peer)]) continue;
      busy_in[static_cast<size_t>(m.peer)] = 1;
      while (!m.done() && try_pull(m)) moved = true;
      if (!m.done()) continue;
      busy_in[static_cast<size_t>(m.peer)] = 0;
    }
    return moved;
  };
  auto pending = [&]() -> int {
    for (const auto& m : in)
      if (!m.done()) return m.peer;
    for (const auto& m : out)
      if (!m.done()) return m.peer;
    return -1;
  };
  for (int peer = pending(); peer >= 0; peer = pending())
    if (!step()) wait_for("the peers of a grouped send/recv", peer, step);
}

size_t ShmTransport::buffered_message_bytes() const {
  return layout_->chunk_payload() * static_cast<size_t>(layout_->k);
}

std::optional<std::span<std::byte>> ShmTransport::arena_allocate(size_t bytes) {
  auto off = arena_free_.allocate(bytes);
  if (!off) return std::nullopt;
  return std::span<std::byte>(own_arena_.data() + *off, bytes);
}

void ShmTransport::arena_free(std::span<std::byte> block) {
  if (block.data() != nullptr) arena_free_.free(static_cast<uint64_t>(block.data() - own_arena_.data()), block.size());
}

std::optional<uint64_t> ShmTransport::arena_offset(const void* p, size_t bytes) const {
  auto* b = static_cast<const std::byte*>(p);
  if (b < own_arena_.data() || b + bytes > own_arena_.data() + own_arena_.size()) return std::nullopt;
  return static_cast<uint64_t>(b - own_arena_.data());
}

const std::byte* ShmTransport::map_peer(int peer, uint64_t offset, size_t bytes) {
  if (peer == rank_) return own_arena_.data() + offset;
  const ShmSegment& seg = peer_arenas_.at(peer);
  if (offset + bytes > seg.size())
    throw CommError(fmt::format("read of {} bytes at offset {} is outside group rank {}'s arena", bytes, offset, peer));
  return seg.data() + offset;
}

void ShmTransport::read_peer(int peer, uint64_t offset, std::span<std::byte> dst) {
  std::memcpy(dst.data(), map_peer(peer, offset, dst.size()), dst.size());
}

}  // namespace loom::comm
