// Helpers shared by the test binaries: the run's random seed (fresh each run, replayable with
// LOOM_TEST_SEED=<n>) and a scope that sets the OpenMP thread count (kernel partitions depend on it).
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <random>

namespace loom::test {

inline uint64_t fresh_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* s = std::getenv("LOOM_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(s, nullptr, 10));
    return (static_cast<uint64_t>(std::random_device{}()) << 32) | static_cast<uint64_t>(std::random_device{}());
  }();
  return seed;
}

class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedThreads() { omp_set_num_threads(saved_); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int saved_;
};

}  // namespace loom::test
