// The interface every collective algorithm is written against (gloo-style): a group of `size` ranks
// that can exchange small records, send/receive ordered messages, and read peers' registered memory.
// Shared memory and MPI implement it; algorithms never see which one they run on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/collective.h"
#include "loom/comm/doorbell.h"

namespace loom::comm {

// Thrown by a transport when a wait passes its deadline; the ProcessGroup turns it into a
// CommTimeoutError that names the op, its sequence number and the group's global ranks.
class Transport;
struct PeerTimeout {
  std::vector<int> missing;  // ranks of `source` that never arrived
  std::string waiting_for;   // "exchange", "message from rank 3", ...
  const Transport* source = nullptr;  // which transport (a hierarchical group has three)
};

// Thrown by a transport when a peer it waits for has exited (comm/peer_liveness.h): the op can never
// complete, so it fails at once instead of at the deadline.
struct PeerGone {
  int global_rank = -1;     // the rank whose process is gone
  std::string waiting_for;  // what this rank was waiting for
};

// A peer's exchange record or message was stamped by another op than the one this rank runs (the
// always-on check: the stamp is the op's descriptor, carried in every record and message header).
struct OpMismatch {
  int peer = -1;  // transport rank of the peer
  OpDesc theirs;
  const Transport* source = nullptr;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;  // "shm" | "mpi"
  int rank() const { return rank_; }
  int size() const { return size_; }

  // The deadline of the op now running; every blocking call below throws PeerTimeout past it.
  void set_deadline(Clock::time_point deadline) { deadline_ = deadline; }
  Clock::time_point deadline() const { return deadline_; }
  // The op now running, as every rank must see it (kind, dtype, reduce, root, count, sequence number).
  // Every exchange record and message carries it and every receiver compares, so ranks that called
  // different ops fail at their first contact instead of hanging. seq == 0: nothing to check.
  void set_stamp(const OpDesc& stamp) { stamp_ = stamp; }
  const OpDesc& stamp() const { return stamp_; }

  // Small all-gather that is also a barrier: every rank contributes up to max_exchange_bytes() and
  // gets a view of every rank's record (records[i].size() is what rank i contributed). The views stay
  // valid until this rank's next exchange call.
  virtual std::vector<std::span<const std::byte>> exchange(std::span<const std::byte> mine) = 0;
  virtual size_t max_exchange_bytes() const = 0;

  // Ordered, tagged messages between two ranks. recv checks the tag and size of what arrives and
  // throws CommError naming both when they differ. Large sends block until the receiver drains them.
  virtual void send(int peer, uint64_t tag, std::span<const std::byte> data) = 0;
  virtual void recv(int peer, uint64_t tag, std::span<std::byte> data) = 0;
  // Sends to `to` while receiving from `from`, interleaved so that a ring of them cannot deadlock.
  virtual void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in) = 0;
  // A group of tagged sends and receives with any peers, all in progress at once, so neighbours that
  // exchange in both directions never wait on each other (torch's batch_isend_irecv). Messages to (and
  // from) one peer go in list order, as separate send / recv calls would.
  struct PeerSend {
    int peer;
    uint64_t tag;
    std::span<const std::byte> data;
  };
  struct PeerRecv {
    int peer;
    uint64_t tag;
    std::span<std::byte> data;
  };
  virtual void send_recv_many(std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) = 0;
  // Bytes of one message a send hands over before its receiver takes any (the channel's buffer; 0 when
  // a large send waits for its receiver, as MPI's rendezvous does): a send that fits never waits for
  // the peer's receive, which some pipeline schedules rely on.
  virtual size_t buffered_message_bytes() const { return 0; }

  // Registered memory: a per-rank arena that peers can read. allocate() returns nullopt when full.
  virtual std::optional<std::span<std::byte>> arena_allocate(size_t bytes) = 0;
  virtual void arena_free(std::span<std::byte> block) = 0;
  // Offset of [p, p+bytes) in this rank's arena, or nullopt if it is not registered memory.
  virtual std::optional<uint64_t> arena_offset(const void* p, size_t bytes) const = 0;
  // True when map_peer gives zero-copy views (then direct algorithms are the default for large ops).
  // Whether read_peer works at all (an MPI transport without a one-sided window cannot).
  virtual bool reads_peers() const { return true; }
  virtual bool maps_peers() const = 0;
  // Zero-copy view of a peer's registered bytes, or nullptr when the transport cannot map peers
  // (then read_peer copies). The caller makes sure the peer's bytes are ready (an exchange).
  virtual const std::byte* map_peer(int peer, uint64_t offset, size_t bytes) = 0;
  virtual void read_peer(int peer, uint64_t offset, std::span<std::byte> dst) = 0;
  // Bytes this rank moved to/from peers through the transport (for tests and `bench comm`).
  virtual uint64_t bytes_sent() const = 0;

 protected:
  Transport(int rank, int size) : rank_(rank), size_(size) {}
  int rank_;
  int size_;
  Clock::time_point deadline_ = Clock::time_point::max();
  OpDesc stamp_{.seq = 0};
  // Throws OpMismatch when a peer's stamp names another op (both stamps set).
  void check_stamp(int peer, const OpDesc& theirs) const {
    if (stamp_.seq == 0 || theirs.seq == 0) return;
    if (theirs.kind != stamp_.kind || theirs.dtype != stamp_.dtype || theirs.reduce != stamp_.reduce ||
        theirs.root != stamp_.root || theirs.count != stamp_.count || theirs.seq != stamp_.seq)
      throw OpMismatch{peer, theirs, this};
  }
};

}  // namespace loom::comm
