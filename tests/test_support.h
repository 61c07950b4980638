// Helpers shared by the test binaries: the run's random seed (fresh each run, replayable with
// LOOM_TEST_SEED=<n>), a scope that sets the OpenMP thread count (kernel partitions depend on it), and
// the message of the ConfigError a call throws.
#pragma once

#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include "loom/error.h"

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

// What the ConfigError `f` throws says; "" when it throws none.
inline std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace loom::test
