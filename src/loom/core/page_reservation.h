// Address space reserved up front whose physical pages exist only once written and can be given back
// while the addresses stay valid. ZeRO-3 keeps each parameter arena this way: every view into it stays
// put, but only this rank's shard and the units gathered right now occupy memory (the CPU analogue of
// mapping and unmapping device memory under a fixed virtual range).
#pragma once

#include <cstddef>
#include <utility>

namespace loom {

class PageReservation {
 public:
  PageReservation() = default;
  // Reserves `bytes` of zero-filled, not yet backed memory (nothing is charged to an Allocator: the
  // owner accounts what it makes resident).
  explicit PageReservation(size_t bytes);
  ~PageReservation();
  PageReservation(PageReservation&& other) noexcept;
  PageReservation& operator=(PageReservation&& other) noexcept;
  PageReservation(const PageReservation&) = delete;
  PageReservation& operator=(const PageReservation&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  // How pages are given back. Eager (MADV_DONTNEED): freed at once and read as zero afterwards; the
  // next write page-faults and the kernel zero-fills. Lazy (MADV_FREE): the kernel frees them only when
  // memory runs short, so a reuse before then costs nothing; their contents are undefined meanwhile
  // and they still count as resident.
  enum class Release { Eager, Lazy };
  // Gives back every page lying wholly inside [offset, offset + bytes). Pages that straddle the range's
  // ends keep their contents (a neighbour may be using them). Returns the bytes given back.
  size_t release(size_t offset, size_t bytes, Release how = Release::Eager);
  // Moves the pages backing [from, from + bytes) to [to, to + bytes) (page-aligned offsets, ranges
  // apart): what backed `to` is dropped, and `from` is left reserved and unbacked. Nothing is copied or
  // faulted in: the page tables move (mremap). Returns the bytes moved, which may fall short (a page
  // at a time) where the kernel refuses; pages that did not move stay at `from`, and their part of
  // `to` is left reserved and unbacked.
  size_t move_pages(size_t from, size_t to, size_t bytes);
  // Bytes of the reservation that are backed by memory now (from mincore; for tests and reports).
  size_t resident_bytes() const;
  static size_t page_size();
  // The whole pages inside [offset, offset + bytes): {first byte, length}; length 0 when there are none.
  // Pages straddling the ends are never given back, moved or shared (a neighbour may be using them).
  static std::pair<size_t, size_t> whole_pages(size_t offset, size_t bytes);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace loom
