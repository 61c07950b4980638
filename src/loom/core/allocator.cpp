#include "loom/core/allocator.h"

#include <cstdlib>
#include <string>

#include "loom/error.h"

namespace loom {

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Parameters: return "parameters";
    case MemCategory::Gradients: return "gradients";
    case MemCategory::Optimizer: return "optimizer";
    case MemCategory::Activations: return "activations";
    case MemCategory::Communication: return "communication";
    case MemCategory::Workspace: return "workspace";
  }
  return "?";
}

namespace {
void raise_peak(std::atomic<size_t>& peak, size_t value) {
  size_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

void* Allocator::allocate(size_t bytes, MemCategory category) {
  if (bytes == 0) return nullptr;
  if (limit_ && total_live_.load(std::memory_order_relaxed) + bytes > limit_)
    throw Error("memory limit: allocating " + std::to_string(bytes) + " bytes for " +
                std::string(mem_category_name(category)) + " would hold " +
                std::to_string(total_live_.load(std::memory_order_relaxed) + bytes) + " bytes, over LOOM_MEMORY_LIMIT = " +
                std::to_string(limit_) + "; use a layout that shards more of the state (ZeRO, tp, pp) or raise the limit");
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr)
    throw Error("out of host memory allocating " + std::to_string(bytes) + " bytes for " +
                std::string(mem_category_name(category)));
  note_change(category, static_cast<ptrdiff_t>(bytes));
  return p;
}

void Allocator::deallocate(void* ptr, size_t bytes, MemCategory category) noexcept {
  if (ptr == nullptr) return;
  std::free(ptr);
  note_change(category, -static_cast<ptrdiff_t>(bytes));
}

void Allocator::note_change(MemCategory category, ptrdiff_t delta) {
  auto i = static_cast<int>(category);
  size_t live = live_[i].fetch_add(static_cast<size_t>(delta), std::memory_order_relaxed) + static_cast<size_t>(delta);
  size_t total = total_live_.fetch_add(static_cast<size_t>(delta), std::memory_order_relaxed) + static_cast<size_t>(delta);
  if (delta > 0) {
    raise_peak(peak_[i], live);
    raise_peak(total_peak_, total);
  }
}

MemStats Allocator::stats(MemCategory category) const {
  auto i = static_cast<int>(category);
  return {live_[i].load(), peak_[i].load()};
}

MemStats Allocator::total() const { return {total_live_.load(), total_peak_.load()}; }

void Allocator::reset_peaks() {
  for (int i = 0; i < kMemCategoryCount; ++i) peak_[i].store(live_[i].load());
  total_peak_.store(total_live_.load());
}

Buffer::Buffer(Allocator& alloc, size_t bytes, MemCategory category)
    : alloc_(&alloc), ptr_(alloc.allocate(bytes, category)), bytes_(bytes), category_(category) {}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : alloc_(other.alloc_), ptr_(other.ptr_), bytes_(other.bytes_), category_(other.category_) {
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    alloc_ = other.alloc_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    category_ = other.category_;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void Buffer::release() noexcept {
  if (alloc_ != nullptr && ptr_ != nullptr) alloc_->deallocate(ptr_, bytes_, category_);
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace loom
