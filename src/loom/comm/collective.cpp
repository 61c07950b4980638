#include "loom/comm/collective.h"

#include <fmt/format.h>

#include "loom/error.h"

namespace loom::comm {

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kAllGatherV: return "all_gather_v";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kAllToAllV: return "all_to_all_v";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kSendRecvMany: return "send_recv_many";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

ReduceOp parse_reduce_op(const std::string& s) {
  if (s == "sum") return ReduceOp::kSum;
  if (s == "avg") return ReduceOp::kAvg;
  if (s == "max") return ReduceOp::kMax;
  if (s == "min") return ReduceOp::kMin;
  throw ConfigError("unknown reduce op '" + s + "': use sum, avg, max or min");
}

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kAuto: return "auto";
    case Algo::kOneShot: return "oneshot";
    case Algo::kDirect: return "direct";
    case Algo::kRing: return "ring";
  }
  return "?";
}

Algo parse_algo(const std::string& s) {
  if (s == "auto") return Algo::kAuto;
  if (s == "oneshot" || s == "one-shot" || s == "one_shot") return Algo::kOneShot;
  if (s == "direct") return Algo::kDirect;
  if (s == "ring") return Algo::kRing;
  throw ConfigError("unknown collective algorithm '" + s + "': use auto, oneshot, direct or ring");
}

std::string describe(const OpDesc& d) {
  std::string what = fmt::format("{}({}", op_name(d.kind), dtype_name(d.dtype));
  if (d.kind == OpKind::kAllReduce || d.kind == OpKind::kReduceScatter || d.kind == OpKind::kReduce)
    what += fmt::format(", {}", reduce_op_name(d.reduce));
  if (d.kind != OpKind::kBarrier) what += fmt::format(", {} elements", d.count);
  if (d.root >= 0) what += fmt::format(", root {}", d.root);
  return what + fmt::format(") #{}", d.seq);
}

}  // namespace loom::comm
