// One POSIX shared-memory segment, mapped read-write: created (mode 0600, exclusive) by one rank and
// opened by its peers, then unlinked as soon as all have mapped it, so a crash leaves nothing behind.
#pragma once

#include <cstddef>
#include <string>

namespace loom::comm {

class ShmSegment {
 public:
  ShmSegment() = default;
  // Creates `name` ("/loom-...") of `bytes`; fails if it already exists (a name collision between
  // jobs must be an error, never a shared segment). Checks /dev/shm has room for `reserve_bytes`.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Opens and maps a segment a peer created; checks its size.
  static ShmSegment open(const std::string& name, size_t bytes);
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Removes the name; the mapping stays valid. Idempotent.
  void unlink();
  std::byte* data() const { return data_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  void release() noexcept;
  std::string name_;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  bool owner_linked_ = false;
};

}  // namespace loom::comm
