// Asynchronous checkpoint saves (`checkpoint.async = true`): at a step boundary rank 0 copies the
// gathered state into a host buffer (CheckpointManager::capture) and this writer puts it on disk on a
// background thread while training goes on. One write at a time: the next save first waits for the one
// in flight, so at most one copy of the state is held. The write is the synchronous save's, atomic the
// same way: a crash mid-write leaves the previous checkpoint and `latest` as they were.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <thread>

#include "loom/train/checkpoint.h"

namespace loom::train {

class AsyncCheckpointWriter {
 public:
  explicit AsyncCheckpointWriter(CheckpointManager& checkpoints) : checkpoints_(checkpoints) {}
  // Waits for a write still in flight (its failure is not rethrown from a destructor).
  ~AsyncCheckpointWriter();
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  struct Saved {
    int64_t step = 0;
    std::string path;
  };
  // The buffer captures copy the state into (CheckpointManager::capture), kept across saves; free
  // once wait() has returned.
  Tensor& buffer() { return buffer_; }
  // Starts writing `image` (whose copy is buffer()); call wait() first. Returns the result of a
  // write that was still in flight, if there was one.
  std::optional<Saved> submit(CheckpointImage image);
  // Without waiting: the write that finished since the last call, if any (rethrows its failure).
  std::optional<Saved> finished();
  // Waits for the write in flight; rethrows its failure.
  std::optional<Saved> wait();
  // A write started and not yet finished.
  bool in_flight() const { return thread_.joinable() && !done_; }

 private:
  std::optional<Saved> join();

  CheckpointManager& checkpoints_;
  Tensor buffer_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  Saved result_;
  std::exception_ptr error_;
};

}  // namespace loom::train
