// Durable file writing: an RAII file descriptor whose every failure (disk full, file-size limit,
// I/O error) becomes an IoError naming the file and the errno text, plus fsync of files and
// directories -- the pieces an atomic "write to temp, fsync, rename, fsync dir" save is built from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom {

class FileWriter {
 public:
  // Creates or truncates `path` with mode 0644. Throws IoError.
  explicit FileWriter(std::string path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t n);
  void sync();   // fsync: the bytes are on stable storage when it returns
  void close();  // reports a deferred write error (NFS, quota) instead of losing it
  uint64_t written() const { return written_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

// fsync a directory, so a rename or a new entry in it survives a power loss. Throws IoError.
void fsync_directory(const std::string& dir);
// Writes `text` to `path` through a temporary file and a rename: readers see the old or the new
// content, never a mix. fsyncs the file and the directory.
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace loom
