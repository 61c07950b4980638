// Pages one part of a reservation gives up that another part needs next, handed over by moving them
// (PageReservation::move_pages) instead of returning them to the kernel and faulting fresh ones in.
// ZeRO-3 gives a block's gathered weights back after use and gathers the next block's at once; on a
// VM that returns freed memory to its host, every page written again costs a fault of several
// microseconds (docs/parallel.md), while a move costs only the page-table update. The pool keeps at
// most `capacity` bytes; what does not fit is given back as before. Pooled pages stay resident: their
// owner accounts for pooled_bytes().
#pragma once

#include <cstddef>
#include <vector>

#include "loom/core/page_reservation.h"

namespace loom {

class PagePool {
 public:
  // capacity 0: a pass-through (every page given back at once with `overflow`).
  PagePool(PageReservation& pages, size_t capacity, PageReservation::Release overflow);

  // [offset, offset + bytes) of the reservation is no longer needed: its whole pages join the pool up
  // to the capacity; the rest are given back with `overflow`. Returns the bytes pooled.
  size_t give(size_t offset, size_t bytes);
  // [offset, offset + bytes) is about to be written whole: backs its whole pages with pooled ones
  // (contents undefined) as far as the pool reaches. Returns the bytes that left the pool.
  size_t take(size_t offset, size_t bytes);
  // Gives every pooled page back with `overflow`. Returns the bytes that left the pool.
  size_t drain();
  size_t pooled_bytes() const { return pooled_; }
  size_t capacity() const { return capacity_; }

 private:
  struct Run {  // pooled pages, byte offsets into the reservation, page-aligned
    size_t begin, end;
  };
  PageReservation& pages_;
  size_t capacity_;
  PageReservation::Release overflow_;
  std::vector<Run> runs_;
  size_t pooled_ = 0;
};

}  // namespace loom
