#include "loom/parallel/trace_merge.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace loom::parallel {

namespace {
constexpr uint64_t kPingTag = 0x7ace0001;
constexpr uint64_t kTraceTag = 0x7ace0002;
constexpr int kRounds = 5;

// This rank's clock minus group rank 0's, in ns (0 on rank 0).
int64_t clock_offset(comm::ProcessGroup& g) {
  const int n = g.size(), me = g.rank();
  int64_t best_offset = 0, best_rtt = std::numeric_limits<int64_t>::max();
  if (me == 0) {
    for (int r = 1; r < n; ++r)
      for (int i = 0; i < kRounds; ++i) {
        int64_t t = 0;
        g.recv(&t, 1, DType::I64, r, kPingTag).wait();
        t = profile::Tracer::now_ns();
        g.send(&t, 1, DType::I64, r, kPingTag).wait();
      }
    return 0;
  }
  for (int i = 0; i < kRounds; ++i) {
    int64_t a = profile::Tracer::now_ns(), b = 0;
    g.send(&a, 1, DType::I64, 0, kPingTag).wait();
    g.recv(&b, 1, DType::I64, 0, kPingTag).wait();
    const int64_t c = profile::Tracer::now_ns();
    if (c - a < best_rtt) {
      best_rtt = c - a;
      best_offset = (a + c) / 2 - b;
    }
  }
  return best_offset;
}
}  // namespace

void write_merged_trace(const profile::Tracer& tracer, comm::ProcessGroup& g, const std::string& path) {
  const int n = g.size(), me = g.rank();
  const int64_t offset = clock_offset(g);
  // The origin is the earliest event of the job, on rank 0's clock.
  int64_t first = tracer.first_event_ns() ? *tracer.first_event_ns() - offset : std::numeric_limits<int64_t>::max();
  g.all_reduce(&first, &first, 1, DType::I64, comm::ReduceOp::kMin).wait();
  int64_t dropped = tracer.dropped_events();
  g.all_reduce(&dropped, &dropped, 1, DType::I64, comm::ReduceOp::kSum).wait();
  std::string mine = tracer.chrome_events_json(first, offset);
  // Bytes travel as int32 elements: the length first, then the padded text.
  if (me != 0) {
    int64_t len = static_cast<int64_t>(mine.size());
    mine.resize((mine.size() + 3) / 4 * 4);
    g.send(&len, 1, DType::I64, 0, kTraceTag).wait();
    g.send(mine.data(), mine.size() / 4, DType::I32, 0, kTraceTag).wait();
    return;
  }
  std::vector<std::string> parts{std::move(mine)};
  for (int r = 1; r < n; ++r) {
    int64_t len = 0;
    g.recv(&len, 1, DType::I64, r, kTraceTag).wait();
    std::string part((static_cast<size_t>(len) + 3) / 4 * 4, '\0');
    g.recv(part.data(), part.size() / 4, DType::I32, r, kTraceTag).wait();
    part.resize(static_cast<size_t>(len));
    parts.push_back(std::move(part));
  }
  profile::Tracer::write_chrome_trace_parts(path, parts, dropped);
}

}  // namespace loom::parallel
