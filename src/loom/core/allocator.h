// Aligned host allocator that accounts live and peak bytes per category, so a run can report where
// its memory goes (parameters, gradients, optimizer state, activations, communication, workspace)
// and the planner's memory model can be checked against measurement.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <string_view>

namespace loom {

enum class MemCategory : int { Parameters, Gradients, Optimizer, Activations, Communication, Workspace };
constexpr int kMemCategoryCount = 6;
std::string_view mem_category_name(MemCategory c);

struct MemStats {
  size_t live = 0;
  size_t peak = 0;
};

class Allocator {
 public:
  static constexpr size_t kAlignment = 64;  // one cache line / one AVX-512 register

  // Returns 64-byte aligned memory; throws loom::Error when the system refuses.
  void* allocate(size_t bytes, MemCategory category);
  void deallocate(void* ptr, size_t bytes, MemCategory category) noexcept;

  // Counts memory obtained elsewhere (the collectives' shared-memory arena) under `category`.
  void note_external(MemCategory category, ptrdiff_t delta) { note_change(category, delta); }

  MemStats stats(MemCategory category) const;
  // Live bytes over all categories, and the high-water mark of that sum.
  MemStats total() const;
  // Starts a new measurement window: peaks drop to the current live bytes.
  void reset_peaks();
  // A cap on live bytes over all categories (0: none), as an accelerator's memory would be: an allocation
  // that would pass it throws loom::Error naming the category and the numbers. Set by LOOM_MEMORY_LIMIT
  // (train::Session), so a test or a user can check that a layout fits a given per-rank memory.
  void set_limit(size_t bytes) { limit_ = bytes; }
  size_t limit() const { return limit_; }

 private:
  void note_change(MemCategory category, ptrdiff_t delta);

  std::array<std::atomic<size_t>, kMemCategoryCount> live_{};
  std::array<std::atomic<size_t>, kMemCategoryCount> peak_{};
  std::atomic<size_t> total_live_{0};
  std::atomic<size_t> total_peak_{0};
  size_t limit_ = 0;
};

// RAII block from an Allocator: the owner of every Loom tensor's storage.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Allocator& alloc, size_t bytes, MemCategory category);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  MemCategory category() const { return category_; }

 private:
  void release() noexcept;
  Allocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::Workspace;
};

}  // namespace loom
