#include "loom/core/page_reservation.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "loom/error.h"

namespace loom {

namespace {
size_t page_size() {
  static const size_t size = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}
}  // namespace

PageReservation::PageReservation(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  // MAP_NORESERVE: the kernel commits a page only when it is first written.
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
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
  const size_t page = page_size();
  const size_t first = (offset + page - 1) / page * page;  // round the start up, the end down
  const size_t last = (offset + bytes) / page * page;
  if (last <= first) return 0;
  // MADV_DONTNEED on private anonymous memory frees the pages at once; the next read sees zeros.
  // MADV_FREE leaves them mapped until the kernel needs memory (Linux >= 4.5).
  const int advice = how == Release::Eager ? MADV_DONTNEED : MADV_FREE;
  if (::madvise(static_cast<char*>(ptr_) + first, last - first, advice) != 0)
    throw Error(std::string("madvise(") + (how == Release::Eager ? "MADV_DONTNEED" : "MADV_FREE") +
                ") failed: " + std::strerror(errno));
  return last - first;
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
