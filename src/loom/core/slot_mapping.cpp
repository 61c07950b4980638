#include "loom/core/slot_mapping.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "loom/error.h"

namespace loom {

SlotMapping::SlotMapping(PageReservation& pages, int slots, size_t slot_bytes) : pages_(pages), slots_(slots) {
  const size_t page = PageReservation::page_size();
  slot_bytes_ = (slot_bytes + page - 1) / page * page;
  fd_ = ::memfd_create("loom-unit-slots", MFD_CLOEXEC);
  if (fd_ < 0) throw Error(std::string("memfd_create failed: ") + std::strerror(errno));
  if (::ftruncate(fd_, static_cast<off_t>(slot_bytes_ * static_cast<size_t>(slots))) != 0) {
    const int err = errno;
    ::close(fd_);
    throw Error(std::string("cannot size the unit slots: ") + std::strerror(err));
  }
}

SlotMapping::~SlotMapping() {
  // The mappings keep the memory alive; they go when the reservation is unmapped.
  if (fd_ >= 0) ::close(fd_);
}

size_t SlotMapping::map(int slot, const std::vector<std::pair<size_t, size_t>>& ranges) {
  if (slot < 0 || slot >= slots_) throw Error("internal: unit slot " + std::to_string(slot) + " out of range");
  size_t at = 0;
  for (const auto& [offset, bytes] : ranges) {
    if (bytes == 0) continue;
    if (at + bytes > slot_bytes_ || offset + bytes > pages_.size())
      throw Error("internal: " + std::to_string(bytes) + " bytes do not fit unit slot of " + std::to_string(slot_bytes_));
    void* want = static_cast<char*>(pages_.data()) + offset;
    void* got = ::mmap(want, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                       static_cast<off_t>(static_cast<size_t>(slot) * slot_bytes_ + at));
    if (got == MAP_FAILED) throw Error(std::string("cannot map a unit slot: ") + std::strerror(errno));
    at += bytes;
  }
  return at;
}

}  // namespace loom
