// Reads back a Chrome/Perfetto trace that Loom wrote (Tracer::write_chrome_trace, or the merged trace of
// a multi-rank job): its complete events ("ph":"X") with category, rank (pid), thread, start and
// duration, and the FLOPs and bytes each span declared. Analysis (trace_analysis.h) works on these.
#pragma once

#include <string>
#include <vector>

#include "loom/profile/tracer.h"

namespace loom::profile {

struct TraceSpan {
  std::string name;
  Category category = Category::Kernel;
  int rank = 0;
  int thread = 0;
  double start_s = 0, duration_s = 0;  // seconds from the trace's origin
  double flops = 0, bytes = 0;
  int unit = SpanContext::kNoUnit;  // where in the model and the step it ran (tracer.h), when recorded
  int micro_batch = -1;
  std::string pass;
  std::string group;  // collective and transfer spans: the process group, the op's sequence number in it
  int64_t seq = -1;   // (collectives), the peer's global rank (point to point)
  int peer = -1;
  double end_s() const { return start_s + duration_s; }
};

// Throws IoError naming the file when it cannot be read or is not a Chrome trace (no "traceEvents"
// array); events of categories Loom does not write are skipped, a malformed event is an error naming
// its index.
std::vector<TraceSpan> read_chrome_trace(const std::string& path);
// The same from the file's text (`what` names it in errors).
std::vector<TraceSpan> parse_chrome_trace(const std::string& text, const std::string& what);

// The category written as `name` (category_name's inverse); false when it is none of Loom's.
bool parse_category(const std::string& name, Category& out);

}  // namespace loom::profile
