// What a collective is, independent of how it runs: the op kinds, reduction operators, element types
// and the descriptor every rank publishes (debug mode compares them across the group).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "loom/core/dtype.h"

namespace loom::comm {

enum class OpKind : uint8_t {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kAllGatherV,
  kBroadcast,
  kReduce,
  kAllToAll,
  kAllToAllV,
  kSend,
  kRecv,
  kSendRecvMany,
  kBarrier,
};
const char* op_name(OpKind kind);

enum class ReduceOp : uint8_t { kSum, kAvg, kMax, kMin };
const char* reduce_op_name(ReduceOp op);
ReduceOp parse_reduce_op(const std::string& s);  // "sum" | "avg" | "max" | "min"

// The algorithms the library implements (DESIGN.md: one family per file, written against Transport).
enum class Algo : uint8_t { kAuto, kOneShot, kDirect, kRing };
const char* algo_name(Algo a);
Algo parse_algo(const std::string& s);  // "auto" | "oneshot" | "direct" | "ring"

// One op as every rank of the group must see it. `count` is the per-rank element count that all
// ranks agree on (all_reduce: the buffer; reduce_scatter: the output chunk; all_gather: the input).
struct OpDesc {
  OpKind kind = OpKind::kBarrier;
  DType dtype = DType::F32;
  ReduceOp reduce = ReduceOp::kSum;
  int32_t root = -1;  // broadcast / reduce
  uint64_t count = 0;
  uint64_t seq = 0;  // per-group sequence number, counted by every rank
};
std::string describe(const OpDesc& d);  // "all_reduce(f32, sum, 1024 elements) #17"

// Tunables; tests and `loom bench comm` override them. The one-shot threshold comes from `loom bench
// comm` with LOOM_COMM_ONE_SHOT_KB=0 vs 128 on the 2-core development machine (docs/comm.md): one-shot
// wins below 8 KiB with registered buffers and below 32 KiB with plain ones; 16 KiB splits the two.
struct Tuning {
  size_t one_shot_max_bytes = size_t{16} << 10;
  Algo forced[static_cast<int>(OpKind::kBarrier) + 1] = {};  // LOOM_COMM_ALGO; kAuto = by size
  size_t inline_max_bytes = size_t{64} << 10;               // ops this small may run in the caller
  bool debug = false;                                       // LOOM_COMM_DEBUG: cross-check every op
  bool check = true;  // LOOM_COMM_CHECK=0 turns off the always-on op stamps (to measure what they cost)
  // LOOM_COMM_TIMEOUT (seconds in the variable): how long one op may wait for its peers. It is sized for
  // reporting a hang (a rank stuck in another op, a deadlock), not for healthy waits: peers arrive within
  // a step's imbalance, and a dead peer on this node is noticed at once (peer_liveness.h). Five minutes
  // covers a slow step of a large model on a loaded machine and still reports a hang in minutes.
  std::chrono::milliseconds timeout{300'000};
};

// The deadline of a barrier that waits for a peer's I/O (rank 0 writing a checkpoint), which may take
// far longer than a hang's timeout.
inline constexpr std::chrono::milliseconds kSaveTimeout = std::chrono::hours(2);

}  // namespace loom::comm
