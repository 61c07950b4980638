#include "loom/train/preemption.h"

#include <csignal>

namespace loom::train {

namespace {
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_signal(int sig) {
  if (g_signal != 0) {  // second request: stop now
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_signal = sig;
}
}  // namespace

void install_preemption_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

bool preemption_requested() { return g_signal != 0; }
int preemption_signal() { return g_signal; }

}  // namespace loom::train
