// Which algorithm runs a collective: one-shot below Tuning::one_shot_max_bytes, direct when the
// transport maps peers' memory (shared memory), the ring otherwise; LOOM_COMM_ALGO forces a choice.
// Hierarchical groups (spanning nodes) compose node-local and inter-node steps.
#pragma once

#include "loom/comm/algorithms.h"
#include "loom/comm/collective.h"
#include "loom/comm/transport.h"

namespace loom::comm {

// Returns the algorithm that ran. Every rank makes the same choice from the same arguments.
Algo run_collective(Transport& t, OpKind kind, const CollArgs& a, const Tuning& tuning);

// all_reduce / reduce_scatter / all_gather over ranks laid out node-major (global rank = node * L +
// local rank): node-local steps on `local` (L ranks), inter-node steps on `cross` (one rank per node).
Algo run_hierarchical(OpKind kind, const CollArgs& a, Transport& local, Transport& cross, const Tuning& tuning);

}  // namespace loom::comm
