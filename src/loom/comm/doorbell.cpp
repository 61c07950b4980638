#include "loom/comm/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <thread>

namespace loom::comm {

namespace {
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // No FUTEX_PRIVATE_FLAG: the word is in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}
}  // namespace

void ring(Doorbell& bell) {
  bell.rings.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_seq_cst) > 0) futex(&bell.rings, FUTEX_WAKE, INT_MAX, nullptr);
}

SpinPolicy spin_policy_for(int ranks_on_node, std::chrono::microseconds spin) {
  unsigned cores = std::thread::hardware_concurrency();
  if (cores == 0) cores = 1;
  return SpinPolicy{static_cast<unsigned>(ranks_on_node) <= cores ? spin : std::chrono::microseconds(0)};
}

namespace detail {
void futex_sleep(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::microseconds max_sleep) {
  timespec ts{};
  ts.tv_sec = max_sleep.count() / 1'000'000;
  ts.tv_nsec = (max_sleep.count() % 1'000'000) * 1000;
  futex(&word, FUTEX_WAIT, seen, &ts);  // EAGAIN (word changed), EINTR and ETIMEDOUT all mean: re-check
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
}  // namespace detail

}  // namespace loom::comm
