// Cross-process waiting on shared memory: each rank owns one doorbell word that peers ring whenever
// they change state the rank may be waiting for. Waiters spin briefly, then sleep on a raw futex.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace loom::comm {

using Clock = std::chrono::steady_clock;

// Lives in shared memory (trivially constructible; zeroed memory is a valid doorbell).
struct alignas(64) Doorbell {
  std::atomic<uint32_t> rings;
  std::atomic<uint32_t> sleepers;
};

// Wakes the doorbell's owner. Call after the state change is stored (seq_cst).
void ring(Doorbell& bell);

// How long a waiter spins before sleeping. With more ranks than cores on a node a spinning waiter
// steals the core the rank it waits for needs, so spinning is then skipped.
struct SpinPolicy {
  std::chrono::nanoseconds spin{50'000};
};
// `spin` (LOOM_COMM_SPIN_US): a peer a step behind usually arrives within tens of microseconds, and a
// futex wake-up of an idle vCPU costs about as much; counted in time, not PAUSEs, whose length differs
// tenfold between CPUs (~18 ns on this AMD EPYC, ~40 ns on Sapphire Rapids).
SpinPolicy spin_policy_for(int ranks_on_node, std::chrono::microseconds spin);

// Waits until `ready()` is true, sleeping on `own` (process-shared futex: std::atomic::wait uses
// private futexes and misses wake-ups from other processes). Returns false if `deadline` passed first.
// Once asleep it calls `check()` every kCheckEvery at most (it may throw: a peer died), so a wait for
// a peer that will never come ends within a slice instead of at the deadline.
inline constexpr std::chrono::milliseconds kCheckEvery{20};
template <class Ready, class Check>
bool wait_on(Doorbell& own, const SpinPolicy& spin, Clock::time_point deadline, Ready&& ready, Check&& check);
template <class Ready>
bool wait_on(Doorbell& own, const SpinPolicy& spin, Clock::time_point deadline, Ready&& ready) {
  return wait_on(own, spin, deadline, ready, [] {});
}

namespace detail {
// Sleeps until the word differs from `seen` or ~`max_sleep` passed (then the caller re-checks).
void futex_sleep(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::microseconds max_sleep);
void cpu_relax();
}  // namespace detail

template <class Ready, class Check>
bool wait_on(Doorbell& own, const SpinPolicy& spin, Clock::time_point deadline, Ready&& ready, Check&& check) {
  if (spin.spin.count() > 0) {
    const auto spin_until = Clock::now() + spin.spin;
    for (int i = 0;; ++i) {
      if (ready()) return true;
      detail::cpu_relax();
      if ((i & 63) == 63 && Clock::now() >= spin_until) break;
    }
  }
  auto checked = Clock::now();
  for (;;) {
    // Dekker-style: read the bell, announce the sleeper, re-check; a ring after our check changes the
    // word, so the futex returns at once instead of missing it.
    uint32_t seen = own.rings.load(std::memory_order_seq_cst);
    own.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (ready()) {
      own.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return true;
    }
    auto now = Clock::now();
    if (now >= deadline) {
      own.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return ready();
    }
    // Sleep in slices so the deadline is honoured even when nobody rings.
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    detail::futex_sleep(own.rings, seen, std::min<std::chrono::microseconds>(left, kCheckEvery));
    own.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return true;
    if (Clock::now() - checked >= kCheckEvery) {
      check();
      checked = Clock::now();
    }
  }
}

}  // namespace loom::comm
