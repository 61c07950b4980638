// Transport for ranks on one node over POSIX shared memory: exchange slots and message channels in
// one control segment per group, and one registered arena per rank that peers map and read in place.
#pragma once

#include <atomic>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/shm_segment.h"
#include "loom/comm/store.h"
#include "loom/comm/arena_free_list.h"
#include "loom/comm/peer_liveness.h"
#include "loom/comm/transport.h"

namespace loom::comm {

struct ShmOptions {
  size_t arena_bytes = size_t{512} << 20;     // LOOM_COMM_ARENA_MB: registered memory per rank
  size_t exchange_bytes = size_t{128} << 10;  // record size of exchange(): bounds the one-shot path
  size_t chunk_bytes = size_t{256} << 10;     // one message slot
  int chunks_per_channel = 4;                 // slots per (sender, receiver) pair
  int ranks_on_node = 0;                      // for the spin policy; 0 = the group size
  int spin_us = 50;                           // LOOM_COMM_SPIN_US: spin before sleeping on the futex
};

class ShmTransport final : public Transport {
 public:
  // Collective over the group: rank 0 creates the control segment, each rank its arena; names are
  // `shm_prefix` + suffix and are published under `key` in the store. Every segment is unlinked once
  // all ranks mapped it. `ranks` are the global ranks (for error messages).
  // `liveness` (may be null) tells when a peer's process is gone, so waits for it end at once.
  static std::unique_ptr<ShmTransport> create(Store& store, const std::string& key, const std::string& shm_prefix,
                                              int rank, const std::vector<int>& ranks, const ShmOptions& options,
                                              Clock::time_point deadline,
                                              std::shared_ptr<const PeerLiveness> liveness = nullptr);
  ~ShmTransport() override;

  const char* name() const override { return "shm"; }
  std::vector<std::span<const std::byte>> exchange(std::span<const std::byte> mine) override;
  size_t max_exchange_bytes() const override { return options_.exchange_bytes; }
  void send(int peer, uint64_t tag, std::span<const std::byte> data) override;
  void recv(int peer, uint64_t tag, std::span<std::byte> data) override;
  void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in) override;
  void send_recv_many(std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) override;
  size_t buffered_message_bytes() const override;
  std::optional<std::span<std::byte>> arena_allocate(size_t bytes) override;
  void arena_free(std::span<std::byte> block) override;
  std::optional<uint64_t> arena_offset(const void* p, size_t bytes) const override;
  bool maps_peers() const override { return true; }
  const std::byte* map_peer(int peer, uint64_t offset, size_t bytes) override;
  void read_peer(int peer, uint64_t offset, std::span<std::byte> dst) override;
  uint64_t bytes_sent() const override { return bytes_sent_.load(std::memory_order_relaxed); }

 private:
  struct Layout;
  struct Message;
  ShmTransport(int rank, int size, const ShmOptions& options);
  void check_peer(int peer, const char* what) const;
  // One step of a send or receive that does not wait; returns true if it moved a chunk.
  bool try_push(Message& m);
  bool try_pull(Message& m);
  void wait_for(const char* what, int peer, const std::function<bool()>& ready);
  // Throws PeerGone if a peer of this group has exited.
  void check_peers_alive(const char* waiting_for) const;

  ShmOptions options_;
  SpinPolicy spin_;
  ShmSegment control_;
  ShmSegment own_arena_;
  std::vector<ShmSegment> peer_arenas_;  // index = group rank (own entry empty)
  std::unique_ptr<Layout> layout_;
  uint64_t exchanges_ = 0;
  std::atomic<uint64_t> bytes_sent_{0};  // read by stats() on another thread
  ArenaFreeList arena_free_;
  std::vector<int> global_ranks_;
  std::shared_ptr<const PeerLiveness> liveness_;
};

}  // namespace loom::comm
