#include "loom/train/async_checkpoint.h"

#include <sys/resource.h>
#include <unistd.h>

#include <memory>

namespace loom::train {

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

std::optional<AsyncCheckpointWriter::Saved> AsyncCheckpointWriter::join() {
  if (!thread_.joinable()) return std::nullopt;
  thread_.join();
  done_ = false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return result_;
}

std::optional<AsyncCheckpointWriter::Saved> AsyncCheckpointWriter::submit(CheckpointImage image) {
  auto previous = join();
  // The image moves into the thread, which frees its copy of the state when the write is done.
  auto owned = std::make_shared<CheckpointImage>(std::move(image));
  thread_ = std::thread([this, owned] {
    // Behind training: the write takes the CPU training leaves idle (waits in collectives, I/O), not
    // the training thread's (a niceness of its own: Linux sets it per thread).
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
    try {
      result_ = {owned->step, checkpoints_.write(*owned)};
    } catch (...) {
      error_ = std::current_exception();
    }
    owned->owned = Tensor();
    done_ = true;
  });
  return previous;
}

std::optional<AsyncCheckpointWriter::Saved> AsyncCheckpointWriter::finished() {
  if (!done_) return std::nullopt;
  return join();
}

std::optional<AsyncCheckpointWriter::Saved> AsyncCheckpointWriter::wait() { return join(); }

}  // namespace loom::train
