// Preemption: the first SIGTERM or SIGINT asks the run to save a checkpoint at the next step
// boundary and exit cleanly; a second one ends the process at once. The request is process-wide
// by nature (signals are), so it is the one piece of global state in train/.
#pragma once

namespace loom::train {

void install_preemption_handlers();
bool preemption_requested();
// The signal number that asked, for the exit message.
int preemption_signal();

}  // namespace loom::train
