// One Chrome trace for a whole job: every rank's spans, each rank a process, on rank 0's clock.
#pragma once

#include <string>

#include "loom/comm/process_group.h"
#include "loom/profile/tracer.h"

namespace loom::parallel {

// Collective over `group`. Each rank measures its clock's offset to group rank 0 (ping-pong over the
// group, the round with the shortest round trip wins: ranks on one node share a clock and measure ~0,
// other nodes' clocks are aligned to within half a round trip), then sends its events to rank 0, which
// writes the merged trace to `path`.
void write_merged_trace(const profile::Tracer& tracer, comm::ProcessGroup& group, const std::string& path);

}  // namespace loom::parallel
