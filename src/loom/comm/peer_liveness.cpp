#include "loom/comm/peer_liveness.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "loom/comm/rendezvous.h"
#include "loom/error.h"

namespace loom::comm {

namespace {
flock whole_file(short type) {
  flock fl{};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0;  // to the end
  return fl;
}
std::string name_of(const std::string& prefix, int rank) { return fmt::format("{}-live-{}", prefix, rank); }
}  // namespace

std::shared_ptr<PeerLiveness> PeerLiveness::create(Store& store, const std::string& key, const std::string& shm_prefix,
                                                   int me, const std::vector<int>& node_ranks,
                                                   Clock::time_point deadline) {
  std::shared_ptr<PeerLiveness> l(new PeerLiveness());
  const int top = node_ranks.empty() ? 0 : *std::max_element(node_ranks.begin(), node_ranks.end());
  l->fds_.assign(static_cast<size_t>(std::max(top, me)) + 1, -1);
  const std::string mine = name_of(shm_prefix, me);
  l->own_fd_ = shm_open(mine.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (l->own_fd_ < 0) throw CommError(fmt::format("cannot create shared memory {}: {}", mine, std::strerror(errno)));
  flock fl = whole_file(F_WRLCK);
  if (ftruncate(l->own_fd_, 1) != 0 || fcntl(l->own_fd_, F_OFD_SETLK, &fl) != 0) {
    const std::string why = std::strerror(errno);
    shm_unlink(mine.c_str());
    throw CommError(fmt::format("cannot lock shared memory {}: {}", mine, why));
  }
  const int index = static_cast<int>(std::find(node_ranks.begin(), node_ranks.end(), me) - node_ranks.begin());
  store_barrier(store, key + "/created", index, node_ranks, deadline);
  for (int r : node_ranks) {
    if (r == me) continue;
    const std::string peer = name_of(shm_prefix, r);
    const int fd = shm_open(peer.c_str(), O_RDONLY, 0600);
    if (fd < 0) {
      shm_unlink(mine.c_str());
      throw CommError(fmt::format("cannot open shared memory {} made by rank {}: {}", peer, r, std::strerror(errno)));
    }
    l->fds_[static_cast<size_t>(r)] = fd;
  }
  store_barrier(store, key + "/opened", index, node_ranks, deadline);
  shm_unlink(mine.c_str());
  return l;
}

PeerLiveness::~PeerLiveness() {
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
  if (own_fd_ >= 0) ::close(own_fd_);  // drops the lock: peers see this rank gone
}

std::optional<int> PeerLiveness::first_gone(std::span<const int> global_ranks) const {
  for (int r : global_ranks) {
    if (r < 0 || static_cast<size_t>(r) >= fds_.size() || fds_[static_cast<size_t>(r)] < 0) continue;
    flock fl = whole_file(F_WRLCK);
    // F_OFD_GETLK reports the lock a peer holds, or F_UNLCK once its process has exited.
    if (fcntl(fds_[static_cast<size_t>(r)], F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK) return r;
  }
  return std::nullopt;
}

}  // namespace loom::comm
