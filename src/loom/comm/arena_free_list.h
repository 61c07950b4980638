// First-fit allocation of page-aligned blocks inside a registered arena (shared memory or an MPI
// window). Thread-safe: register_buffer runs on the caller's thread, staging on the progress thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>

namespace loom::comm {

class ArenaFreeList {
 public:
  explicit ArenaFreeList(size_t bytes = 0) { reset(bytes); }
  void reset(size_t bytes);
  std::optional<uint64_t> allocate(size_t bytes);
  void free(uint64_t offset, size_t bytes);

 private:
  static size_t block_size(size_t bytes);  // page-aligned: blocks never share a cache line
  std::mutex mu_;
  std::map<uint64_t, size_t> free_;  // offset -> bytes, coalesced
};

}  // namespace loom::comm
