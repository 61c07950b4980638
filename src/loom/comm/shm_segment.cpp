#include "loom/comm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "loom/error.h"

namespace loom::comm {

namespace {
std::string errno_text() { return std::strerror(errno); }

std::byte* map(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw CommError("cannot map shared memory " + name + ": " + errno_text());
  return static_cast<std::byte*>(p);
}
}  // namespace

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  // tmpfs allocates pages lazily: a segment larger than /dev/shm's free space would map fine and then
  // kill the process with SIGBUS on first touch. Refuse up front instead.
  struct statvfs vfs{};
  if (statvfs("/dev/shm", &vfs) == 0) {
    unsigned long long avail = static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize;
    if (bytes > avail)
      throw CommError("shared memory segment " + name + " needs " + std::to_string(bytes >> 20) +
                      " MiB but /dev/shm has " + std::to_string(avail >> 20) +
                      " MiB free: lower LOOM_COMM_ARENA_MB or enlarge /dev/shm");
  }
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw CommError("cannot create shared memory " + name + ": " + errno_text());
  ShmSegment seg;
  seg.name_ = name;
  seg.owner_linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::string why = errno_text();
    close(fd);
    shm_unlink(name.c_str());
    throw CommError("cannot size shared memory " + name + ": " + why);
  }
  try {
    seg.data_ = map(fd, bytes, name);
  } catch (...) {
    close(fd);
    shm_unlink(name.c_str());
    throw;
  }
  close(fd);
  seg.bytes_ = bytes;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw CommError("cannot open shared memory " + name + " made by a peer: " + errno_text());
  struct stat st{};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    throw CommError("shared memory " + name + " has " + std::to_string(st.st_size) + " bytes, expected " +
                    std::to_string(bytes) + " (ranks disagree on LOOM_COMM_* settings?)");
  }
  ShmSegment seg;
  seg.name_ = name;
  try {
    seg.data_ = map(fd, bytes, name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  seg.bytes_ = bytes;
  return seg;
}

ShmSegment::~ShmSegment() { release(); }

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      owner_linked_(std::exchange(other.owner_linked_, false)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    owner_linked_ = std::exchange(other.owner_linked_, false);
  }
  return *this;
}

void ShmSegment::unlink() {
  if (owner_linked_) {
    shm_unlink(name_.c_str());
    owner_linked_ = false;
  }
}

void ShmSegment::release() noexcept {
  if (owner_linked_) shm_unlink(name_.c_str());  // never leave a name behind, even on error paths
  owner_linked_ = false;
  if (data_) munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace loom::comm
