#include "loom/comm/mpi_transport.h"

#include "loom/comm/doorbell.h"

#include <fmt/format.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstring>

#include "loom/error.h"

namespace loom::comm {

namespace {

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw CommError(fmt::format("MPI {} failed: {}", what, std::string(text, len)));
  }
}
}  // namespace

void ensure_mpi_initialized() {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return;
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_MULTIPLE)
    throw UnsupportedError(
        "this MPI library does not provide MPI_THREAD_MULTIPLE, which Loom's progress threads need "
        "(use Debian's OpenMPI 4.1, or run with --comm shm on one node)");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

bool mpi_is_initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void finalize_mpi() {
  if (mpi_is_initialized()) MPI_Finalize();
}

MpiTransport::MpiTransport(MPI_Comm comm, size_t arena_bytes) : Transport(0, 1), comm_(comm), arena_bytes_(arena_bytes) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  int* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &flag);
  if (flag && ub) tag_ub_ = *ub;
  void* mem = nullptr;
  check(MPI_Alloc_mem(static_cast<MPI_Aint>(arena_bytes_), MPI_INFO_NULL, &mem), "MPI_Alloc_mem (arena)");
  arena_ = static_cast<std::byte*>(mem);
  arena_free_.reset(arena_bytes_);
  // The window serves read_peer, for callers outside the algorithms (which never read peers over MPI:
  // see reads_peers()). Some OpenMPI set-ups cannot create one (a single process; the vader BTL
  // without single-copy): the transport then works without it and read_peer says so.
  if (size_ > 1 && MPI_Win_create(arena_, static_cast<MPI_Aint>(arena_bytes_), 1, MPI_INFO_NULL, comm_, &win_) == MPI_SUCCESS) {
    check(MPI_Win_lock_all(0, win_), "MPI_Win_lock_all");
  } else {
    win_ = MPI_WIN_NULL;
  }
}

MpiTransport::~MpiTransport() {
  if (!mpi_is_initialized()) return;
  if (win_ != MPI_WIN_NULL) {
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
  }
  if (arena_) MPI_Free_mem(arena_);
  MPI_Comm_free(&comm_);
}

std::unique_ptr<MpiTransport> MpiTransport::split(int color, int key, size_t arena_bytes) {
  MPI_Comm sub = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split");
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiTransport>(sub, arena_bytes);
}

int MpiTransport::user_tag(uint64_t tag) const {
  // The top tag is reserved for the algorithms' own messages.
  return static_cast<int>(tag % static_cast<uint64_t>(tag_ub_));
}

// Polls instead of blocking in MPI so the deadline holds; yields, then naps, so ranks sharing cores
// are not starved by a spinning peer.
void MpiTransport::wait(MPI_Request* reqs, int n, const char* what, int peer) {
  int spins = 0;
  for (;;) {
    int done = 0;
    check(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
    if (Clock::now() > deadline_) {
      for (int i = 0; i < n; ++i)
        if (reqs[i] != MPI_REQUEST_NULL) MPI_Cancel(&reqs[i]);
      throw PeerTimeout{peer >= 0 ? std::vector<int>{peer} : std::vector<int>{}, what, this};
    }
    backoff(spins);
  }
}

// Spins ~20 us (a peer a step behind arrives within that), then naps 20 us at a time: sched_yield
// stalled for milliseconds on this VM, and a spinner would starve oversubscribed ranks.
void MpiTransport::backoff(int& spins) {
  if (spins == 0) spin_until_ = Clock::now() + std::chrono::microseconds(20);
  ++spins;
  if (Clock::now() < spin_until_) {
    for (int i = 0; i < 32; ++i) detail::cpu_relax();
    return;
  }
  timespec ts{0, 20'000};
  nanosleep(&ts, nullptr);
}

std::vector<std::span<const std::byte>> MpiTransport::exchange(std::span<const std::byte> mine) {
  if (mine.size() > max_exchange_bytes())
    throw CommError(fmt::format("exchange of {} bytes exceeds the {}-byte record", mine.size(), max_exchange_bytes()));
  int my_size = static_cast<int>(mine.size());
  // Sizes travel with each rank's op stamp, so ranks in different ops fail here instead of hanging.
  struct Head {
    int32_t size;
    OpDesc stamp;
  };
  Head my_head{my_size, stamp_};
  std::vector<Head> heads(size_);
  MPI_Request req;
  check(MPI_Iallgather(&my_head, sizeof(Head), MPI_BYTE, heads.data(), sizeof(Head), MPI_BYTE, comm_, &req),
        "MPI_Iallgather");
  wait(&req, 1, "exchange (MPI allgather of sizes)", -1);
  record_sizes_.assign(size_, 0);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) check_stamp(r, heads[r].stamp);
    record_sizes_[r] = heads[r].size;
  }
  std::vector<int> displs(size_ + 1, 0);
  for (int r = 0; r < size_; ++r) displs[r + 1] = displs[r] + record_sizes_[r];
  records_.resize(std::max(1, displs[size_]));
  check(MPI_Iallgatherv(mine.data(), my_size, MPI_BYTE, records_.data(), record_sizes_.data(), displs.data(), MPI_BYTE,
                        comm_, &req),
        "MPI_Iallgatherv");
  wait(&req, 1, "exchange (MPI allgatherv)", -1);
  bytes_sent_ += mine.size();
  std::vector<std::span<const std::byte>> views(size_);
  for (int r = 0; r < size_; ++r) views[r] = {records_.data() + displs[r], static_cast<size_t>(record_sizes_[r])};
  return views;
}

void MpiTransport::send(int peer, uint64_t tag, std::span<const std::byte> data) {
  if (data.size() > static_cast<size_t>(INT32_MAX)) throw CommError("MPI send of more than 2 GiB in one message");
  MPI_Request req;
  check(MPI_Isend(data.data(), static_cast<int>(data.size()), MPI_BYTE, peer, user_tag(tag), comm_, &req), "MPI_Isend");
  wait(&req, 1, "the peer to receive a message", peer);
  bytes_sent_ += data.size();
}

void MpiTransport::recv(int peer, uint64_t tag, std::span<std::byte> data) {
  // Probe first so that a message of the wrong size is named, not truncated.
  int flag = 0, spins = 0;
  MPI_Status st;
  for (;;) {
    check(MPI_Iprobe(peer, user_tag(tag), comm_, &flag, &st), "MPI_Iprobe");
    if (flag) break;
    if (Clock::now() > deadline_) throw PeerTimeout{{peer}, "a message from the peer", this};
    backoff(spins);
  }
  int count = 0;
  MPI_Get_count(&st, MPI_BYTE, &count);
  if (static_cast<size_t>(count) != data.size())
    throw CommError(fmt::format("group rank {} expected {} bytes with tag {} from group rank {}, but {} arrived", rank_,
                                data.size(), tag, peer, count));
  MPI_Request req;
  check(MPI_Irecv(data.data(), count, MPI_BYTE, peer, user_tag(tag), comm_, &req), "MPI_Irecv");
  wait(&req, 1, "a message from the peer", peer);
}

void MpiTransport::send_recv_many(std::span<const PeerSend> sends, std::span<const PeerRecv> recvs) {
  // MPI orders messages between two ranks with the same tag, and all of them progress at once.
  std::vector<MPI_Request> reqs;
  for (const auto& m : recvs) {
    if (m.data.size() > static_cast<size_t>(INT32_MAX)) throw CommError("MPI receive of more than 2 GiB in one message");
    reqs.emplace_back();
    check(MPI_Irecv(m.data.data(), static_cast<int>(m.data.size()), MPI_BYTE, m.peer, user_tag(m.tag), comm_, &reqs.back()),
          "MPI_Irecv");
  }
  for (const auto& m : sends) {
    if (m.data.size() > static_cast<size_t>(INT32_MAX)) throw CommError("MPI send of more than 2 GiB in one message");
    reqs.emplace_back();
    check(MPI_Isend(m.data.data(), static_cast<int>(m.data.size()), MPI_BYTE, m.peer, user_tag(m.tag), comm_, &reqs.back()),
          "MPI_Isend");
    bytes_sent_ += m.data.size();
  }
  if (!reqs.empty())
    wait(reqs.data(), static_cast<int>(reqs.size()), "the peers of a grouped send/recv",
         !recvs.empty() ? recvs.front().peer : sends.front().peer);
}

void MpiTransport::send_recv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in) {
  // Large messages go in 64 MiB pieces: MPI counts are ints.
  constexpr size_t kPiece = size_t{64} << 20;
  size_t so = 0, ro = 0;
  do {
    const size_t sn = std::min(kPiece, out.size() - so), rn = std::min(kPiece, in.size() - ro);
    MPI_Request reqs[2];
    check(MPI_Irecv(in.data() + ro, static_cast<int>(rn), MPI_BYTE, from, tag_ub_, comm_, &reqs[0]), "MPI_Irecv");
    check(MPI_Isend(out.data() + so, static_cast<int>(sn), MPI_BYTE, to, tag_ub_, comm_, &reqs[1]), "MPI_Isend");
    wait(reqs, 2, "the peers of a ring step", from);
    bytes_sent_ += sn;
    so += sn;
    ro += rn;
  } while (so < out.size() || ro < in.size());
}

std::optional<std::span<std::byte>> MpiTransport::arena_allocate(size_t bytes) {
  auto off = arena_free_.allocate(bytes);
  if (!off) return std::nullopt;
  return std::span<std::byte>(arena_ + *off, bytes);
}

void MpiTransport::arena_free(std::span<std::byte> block) {
  if (block.data() != nullptr) arena_free_.free(static_cast<uint64_t>(block.data() - arena_), block.size());
}

std::optional<uint64_t> MpiTransport::arena_offset(const void* p, size_t bytes) const {
  auto* b = static_cast<const std::byte*>(p);
  if (b < arena_ || b + bytes > arena_ + arena_bytes_) return std::nullopt;
  return static_cast<uint64_t>(b - arena_);
}

void MpiTransport::read_peer(int peer, uint64_t offset, std::span<std::byte> dst) {
  if (peer == rank_) {
    std::memcpy(dst.data(), arena_ + offset, dst.size());
    return;
  }
  if (win_ == MPI_WIN_NULL)
    throw CommError("MPI one-sided window unavailable: this MPI could not create one, so peers cannot be read "
                    "directly (use LOOM_COMM_ALGO=ring)");
  constexpr size_t kPiece = size_t{64} << 20;
  for (size_t done = 0; done < dst.size(); done += kPiece) {
    const size_t n = std::min(kPiece, dst.size() - done);
    check(MPI_Get(dst.data() + done, static_cast<int>(n), MPI_BYTE, peer, static_cast<MPI_Aint>(offset + done),
                  static_cast<int>(n), MPI_BYTE, win_),
          "MPI_Get");
  }
  check(MPI_Win_flush(peer, win_), "MPI_Win_flush");
}

}  // namespace loom::comm
