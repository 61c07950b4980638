// A few slots of physical memory, each mapped at the addresses of several parts of a reservation that
// are never in use at the same time. ZeRO-2/3 keep the non-owned part of one block's gradients, or of
// its gathered bf16 weights, only while that block is being worked on, and blocks take turns; so block
// u can live in slot u mod 2 for good. The memory is then two blocks' worth, as with giving pages back
// after each use, but the pages stay mapped: no fault, no move, no page-table change during a step
// (on this VM every re-faulted or moved page costs microseconds, BENCHMARKS.md). The owner must make
// sure two parts sharing a slot are never live together.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "loom/core/page_reservation.h"

namespace loom {

class SlotMapping {
 public:
  // `slots` x `slot_bytes` (rounded up to whole pages) of shared anonymous memory; nothing mapped yet.
  SlotMapping(PageReservation& pages, int slots, size_t slot_bytes);
  ~SlotMapping();
  SlotMapping(const SlotMapping&) = delete;
  SlotMapping& operator=(const SlotMapping&) = delete;

  // Maps slot k, from its start, over the given byte ranges of the reservation (page-aligned, as
  // PageReservation::whole_pages returns), one after the other. Returns the bytes mapped; throws if they exceed the slot.
  size_t map(int slot, const std::vector<std::pair<size_t, size_t>>& ranges);
  size_t slot_bytes() const { return slot_bytes_; }
  int slots() const { return slots_; }

 private:
  PageReservation& pages_;
  int slots_;
  size_t slot_bytes_;
  int fd_ = -1;
};

}  // namespace loom
