// Transport over an MPI communicator (OpenMPI): between nodes, and everywhere with `--comm mpi`.
// Waits poll non-blocking requests so the watchdog deadline holds; peers' registered memory is read
// with MPI_Get through a window over the arena (copying: MPI cannot map a peer's memory).
#pragma once

#include <atomic>

#include <mpi.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "loom/comm/arena_free_list.h"
#include "loom/comm/transport.h"

namespace loom::comm {

class MpiTransport final : public Transport {
 public:
  // Takes ownership of `comm`. Collective over it (creates the arena's window).
  MpiTransport(MPI_Comm comm, size_t arena_bytes);
  ~MpiTransport() override;

  // Collective over this communicator; color < 0 gets nullptr.
  std::unique_ptr<MpiTransport> split(int color, int key, size_t arena_bytes);

  const char* name() const override { return "mpi"; }
  std::vector<std::span<const std::byte>> exchange(std::span<const std::byte> mine) override;
  size_t max_exchange_bytes() const override { return size_t{128} << 10; }
  void send(int peer, uint64_t tag, std::span<const std::byte> data) override;
  void recv(int peer, uint64_t tag, std::span<std::byte> data) override;
  void send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in) override;
  void send_recv_many(std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) override;
  std::optional<std::span<std::byte>> arena_allocate(size_t bytes) override;
  void arena_free(std::span<std::byte> block) override;
  std::optional<uint64_t> arena_offset(const void* p, size_t bytes) const override;
  bool maps_peers() const override { return false; }
  // read_peer works (MPI_Get), but the algorithms must not rely on it: without hardware RDMA,
  // OpenMPI's passive-target MPI_Get progresses only while the target calls into MPI, and a target
  // sleeping in a node-local shared-memory phase then deadlocks the job (seen in the hierarchical
  // test). A forced direct algorithm therefore runs as the ring over MPI.
  bool reads_peers() const override { return false; }
  const std::byte* map_peer(int, uint64_t, size_t) override { return nullptr; }
  void read_peer(int peer, uint64_t offset, std::span<std::byte> dst) override;
  uint64_t bytes_sent() const override { return bytes_sent_.load(std::memory_order_relaxed); }

 private:
  void wait(MPI_Request* reqs, int n, const char* what, int peer);
  int user_tag(uint64_t tag) const;

  MPI_Comm comm_;
  MPI_Win win_ = MPI_WIN_NULL;
  std::byte* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  ArenaFreeList arena_free_;
  std::vector<std::byte> records_;
  std::vector<int> record_sizes_;
  int tag_ub_ = 32767;
  void backoff(int& spins);
  Clock::time_point spin_until_{};
  std::atomic<uint64_t> bytes_sent_{0};  // read by stats() on another thread
};

// Initialises MPI with MPI_THREAD_MULTIPLE once per process (groups' progress threads call MPI
// concurrently); throws UnsupportedError if the library cannot provide it.
void ensure_mpi_initialized();
bool mpi_is_initialized();
void finalize_mpi();

}  // namespace loom::comm
