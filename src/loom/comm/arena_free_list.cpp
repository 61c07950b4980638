#include "loom/comm/arena_free_list.h"

#include <algorithm>
#include <iterator>

namespace loom::comm {

size_t ArenaFreeList::block_size(size_t bytes) {
  constexpr size_t kPage = 4096;
  return (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
}

void ArenaFreeList::reset(size_t bytes) {
  std::lock_guard lock(mu_);
  free_.clear();
  if (bytes) free_[0] = bytes;
}

std::optional<uint64_t> ArenaFreeList::allocate(size_t bytes) {
  const size_t need = block_size(bytes);
  std::lock_guard lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t off = it->first;
    const size_t left = it->second - need;
    free_.erase(it);
    if (left) free_[off + need] = left;
    return off;
  }
  return std::nullopt;
}

void ArenaFreeList::free(uint64_t offset, size_t bytes) {
  std::lock_guard lock(mu_);
  auto [it, inserted] = free_.emplace(offset, block_size(bytes));
  if (!inserted) return;  // a double free is ignored rather than corrupting the list
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

}  // namespace loom::comm
