#include "loom/core/page_reservation.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "loom/error.h"

namespace loom {

size_t PageReservation::page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

std::pair<size_t, size_t> PageReservation::whole_pages(size_t offset, size_t bytes) {
  const size_t page = page_size();
  const size_t first = (offset + page - 1) / page * page, last = (offset + bytes) / page * page;  // start up, end down
  return {first, last > first ? last - first : 0};
}

namespace {
constexpr int kReserveProt = PROT_READ | PROT_WRITE;
constexpr int kReserveFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
}  // namespace

PageReservation::PageReservation(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  // MAP_NORESERVE: the kernel commits a page only when it is first written.
  void* p = ::mmap(nullptr, bytes, kReserveProt, kReserveFlags, -1, 0);
  if (p == MAP_FAILED)
    throw Error("cannot reserve " + std::to_string(bytes) + " bytes of address space: " + std::strerror(errno));
  ptr_ = p;
}

PageReservation::~PageReservation() {
  if (ptr_ != nullptr) ::munmap(ptr_, bytes_);
}

PageReservation::PageReservation(PageReservation&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

PageReservation& PageReservation::operator=(PageReservation&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) ::munmap(ptr_, bytes_);
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

size_t PageReservation::release(size_t offset, size_t bytes, Release how) {
  if (ptr_ == nullptr || bytes == 0) return 0;
  if (offset + bytes > bytes_)
    throw Error("internal: page release [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                ") outside a reservation of " + std::to_string(bytes_) + " bytes");
  const auto [first, length] = whole_pages(offset, bytes);
  if (length == 0) return 0;
  // MADV_DONTNEED on private anonymous memory frees the pages at once; the next read sees zeros.
  // MADV_FREE leaves them mapped until the kernel needs memory (Linux >= 4.5).
  const int advice = how == Release::Eager ? MADV_DONTNEED : MADV_FREE;
  if (::madvise(static_cast<char*>(ptr_) + first, length, advice) != 0)
    throw Error(std::string("madvise(") + (how == Release::Eager ? "MADV_DONTNEED" : "MADV_FREE") +
                ") failed: " + std::strerror(errno));
  return length;
}

size_t PageReservation::move_pages(size_t from, size_t to, size_t bytes) {
  const size_t page = page_size();
  if (ptr_ == nullptr || bytes == 0) return 0;
  if (from % page || to % page || bytes % page || from + bytes > bytes_ || to + bytes > bytes_ ||
      (from < to + bytes && to < from + bytes))
    throw Error("internal: page move [" + std::to_string(from) + ", +" + std::to_string(bytes) + ") -> " +
                std::to_string(to) + " is not page-aligned, inside the reservation and apart");
  char* base = static_cast<char*>(ptr_);
  // mremap moves one mapping at a time: a range that earlier moves cut into several mappings fails with
  // EFAULT, so it is moved in halves down to single pages.
  void* moved = ::mremap(base + from, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, base + to);
  if (moved == MAP_FAILED) {
    // The kernel may have unmapped the destination before refusing: reserve it again, so no address of
    // the arena is ever left unmapped.
    if (::mmap(base + to, bytes, kReserveProt, kReserveFlags | MAP_FIXED, -1, 0) == MAP_FAILED)
      throw Error(std::string("cannot re-reserve address space after a refused page move: ") + std::strerror(errno));
    if (bytes == page) return 0;
    const size_t half = bytes / page / 2 * page;
    return move_pages(from, to, half) + move_pages(from + half, to + half, bytes - half);
  }
  // The source is a hole now: reserve it again so every address of the arena stays valid.
  if (::mmap(base + from, bytes, kReserveProt, kReserveFlags | MAP_FIXED, -1, 0) == MAP_FAILED) {
    const int err = errno;
    if (::mremap(base + to, bytes, bytes, MREMAP_MAYMOVE | MREMAP_FIXED, base + from) != MAP_FAILED &&
        ::mmap(base + to, bytes, kReserveProt, kReserveFlags | MAP_FIXED, -1, 0) != MAP_FAILED)
      return 0;
    throw Error(std::string("cannot re-reserve address space after moving pages: ") + std::strerror(err));
  }
  return bytes;
}

size_t PageReservation::resident_bytes() const {
  if (ptr_ == nullptr) return 0;
  const size_t page = page_size();
  std::vector<unsigned char> in_core((bytes_ + page - 1) / page);
  if (::mincore(ptr_, bytes_, in_core.data()) != 0) return 0;
  size_t n = 0;
  for (unsigned char c : in_core) n += c & 1;
  return n * page;
}

}  // namespace loom
