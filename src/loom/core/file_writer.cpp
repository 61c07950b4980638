#include "loom/core/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "loom/error.h"

namespace loom {

namespace {
std::string errno_text(int e) {
  if (e == ENOSPC) return "no space left on device";
  if (e == EFBIG) return "file too large (file-size limit reached)";
  if (e == EDQUOT) return "disk quota exceeded";
  return std::strerror(e);
}
}  // namespace

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError("cannot create '" + path_ + "': " + errno_text(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError("writing '" + path_ + "' failed after " + std::to_string(written_) + " bytes: " + errno_text(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<uint64_t>(w);
  }
}

void FileWriter::sync() {
  if (::fsync(fd_) != 0) throw IoError("fsync of '" + path_ + "' failed: " + errno_text(errno));
}

void FileWriter::close() {
  int fd = fd_;
  fd_ = -1;
  if (fd >= 0 && ::close(fd) != 0) throw IoError("closing '" + path_ + "' failed: " + errno_text(errno));
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open directory '" + dir + "': " + errno_text(errno));
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) throw IoError("fsync of directory '" + dir + "' failed: " + errno_text(e));
}

void write_file_atomically(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  std::string tmp = path + ".tmp" + std::to_string(::getpid());
  try {
    FileWriter w(tmp);
    w.write(text.data(), text.size());
    w.sync();
    w.close();
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) throw IoError("cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  fs::path parent = fs::path(path).parent_path();
  fsync_directory(parent.empty() ? "." : parent.string());
}

}  // namespace loom
