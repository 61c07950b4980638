// Which ranks on this node are still running: each rank holds a lock on a small shared-memory object of
// its own (an open-file-description lock), which the kernel drops the moment the process exits, even
// before its parent reaps it; peers test that lock. So a rank blocked in a collective learns within one
// sleep slice that the peer it waits for is gone, instead of waiting for LOOM_COMM_TIMEOUT. Unlike a PID
// it cannot be reused by another process, and it works across PID namespaces that share /dev/shm.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/doorbell.h"
#include "loom/comm/store.h"

namespace loom::comm {

class PeerLiveness {
 public:
  // Collective over `node_ranks` (global ranks on this node; this process is `me`): each creates and
  // locks `<shm_prefix>-live-<rank>`, opens its peers', and unlinks its own once all have opened.
  static std::shared_ptr<PeerLiveness> create(Store& store, const std::string& key, const std::string& shm_prefix,
                                              int me, const std::vector<int>& node_ranks, Clock::time_point deadline);
  ~PeerLiveness();
  PeerLiveness(const PeerLiveness&) = delete;
  PeerLiveness& operator=(const PeerLiveness&) = delete;

  // The first of `global_ranks` that is watched (on this node) and has exited, if any. One fcntl per
  // watched rank: call it from slow paths (a wait that went to sleep), not per message.
  std::optional<int> first_gone(std::span<const int> global_ranks) const;

 private:
  PeerLiveness() = default;
  int own_fd_ = -1;
  std::vector<int> fds_;  // by global rank; -1: not watched (another node, or this process)
};

}  // namespace loom::comm
