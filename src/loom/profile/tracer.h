// Tracer: timed spans with a category, FLOPs and bytes, aggregated per name and (optionally) kept as
// events for a Chrome/Perfetto trace. Usable from every layer; passed explicitly, never global.
// Off: a span is one branch and no clock read. Summary: two clock reads and a table update.
// Full: Summary plus an event appended to a buffer.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace loom::profile {

// Communication: time a thread spent waiting on a collective (exposed). InFlight: an asynchronous
// collective from issue to completion, with compute running under it; its wait is a Communication span
// named "<in-flight name>.wait", and the in-flight time no wait covers was hidden (overlapped).
// CommWork: a collective or transfer as the group's progress thread runs it (what moves the data), beside
// the training thread's Communication waits for it.
enum class Category { Gemm, Kernel, Communication, Host, Step, InFlight, CommWork };
const char* category_name(Category c);

// What the calling thread is computing, recorded with each span it closes (Full mode): the model's
// unit (-1 embeddings, 0..L-1 blocks, L the final norm and head; kNoUnit outside them), the micro-batch
// (-1 outside one) and the pass ("F" forward, "B" backward, "BI" / "BW" its input- and weight-gradient
// halves; nullptr outside). The model and the trainer set it with ScopedSpanContext.
struct SpanContext {
  static constexpr int kNoUnit = -1000000;
  int unit = kNoUnit;
  int micro_batch = -1;
  const char* pass = nullptr;  // a string literal
  // A collective's spans (CommWork): its group, sequence number in it and algorithm (strings that
  // outlive the trace: the group's id, a static name).
  // The training thread's waits carry the same group and sequence number (comm::mark_wait), so a wait
  // and the work it waited for are one collective across ranks; point-to-point spans name their peer.
  const char* group = nullptr;
  int64_t seq = -1;
  const char* algorithm = nullptr;
  int peer = -1;  // global rank
};
SpanContext& span_context();  // this thread's

// Sets fields of this thread's SpanContext for a scope (a negative / null argument leaves that field as
// it is) and restores them after.
class ScopedSpanContext {
 public:
  explicit ScopedSpanContext(int unit, const char* pass = nullptr, int micro_batch = -1)
      : saved_(span_context()) {
    auto& c = span_context();
    if (unit != SpanContext::kNoUnit) c.unit = unit;
    if (pass) c.pass = pass;
    if (micro_batch >= 0) c.micro_batch = micro_batch;
  }
  ~ScopedSpanContext() { span_context() = saved_; }
  ScopedSpanContext(const ScopedSpanContext&) = delete;
  ScopedSpanContext& operator=(const ScopedSpanContext&) = delete;

 private:
  SpanContext saved_;
};

struct SpanStats {
  Category category = Category::Kernel;
  int64_t calls = 0;
  double seconds = 0;
  double flops = 0;
  double bytes = 0;
};

struct Event {
  std::string name;
  Category category;
  int64_t start_ns;
  int64_t duration_ns;
  double flops;
  double bytes;
  int rank;
  SpanContext context;
};

// A counter sample (Chrome trace "ph":"C"): named series' values at one moment, shown by Perfetto as a
// track of its own (e.g. each expert's tokens per step).
struct CounterSample {
  std::string name;
  int64_t at_ns;
  std::vector<std::pair<std::string, double>> values;
};

class Tracer {
 public:
  enum class Mode { Off, Summary, Full };
  explicit Tracer(Mode mode = Mode::Off, int rank = 0) : mode_(mode), rank_(rank) {}

  Mode mode() const { return mode_; }
  bool on() const { return mode_ != Mode::Off; }
  static int64_t now_ns();

  void record(const char* name, Category category, int64_t start_ns, int64_t end_ns, double flops, double bytes);
  // A counter sample now (Full mode only; it is not a span and enters no statistics).
  void counter(std::string name, std::vector<std::pair<std::string, double>> values);

  // Per-name totals since construction or the last reset (e.g. after warm-up steps).
  std::map<std::string, SpanStats> stats() const;
  void reset_stats();
  size_t event_count() const;
  // Chrome trace JSON ("traceEvents", complete events, microseconds): opens in Perfetto / chrome://tracing.
  // Throws loom::IoError when the file cannot be written.
  void write_chrome_trace(const std::string& path) const;
  // This rank's part of a merged trace: its process-name record and events as Chrome trace JSON
  // objects, each preceded by ",\n", with timestamps (now_ns clock) shifted by -clock_offset_ns onto
  // the reference rank's clock and taken relative to origin_ns.
  std::string chrome_events_json(int64_t origin_ns, int64_t clock_offset_ns) const;
  // Earliest event start (now_ns clock), or nullopt without events.
  std::optional<int64_t> first_event_ns() const;
  int64_t dropped_events() const;
  // Writes a Chrome trace file from the parts chrome_events_json produced (one per rank).
  static void write_chrome_trace_parts(const std::string& path, const std::vector<std::string>& parts, int64_t dropped);
  // Before a traced run starts: creates the trace file's folder and checks the file can be written
  // there (without touching an existing file), so a bad path is refused before any work rather than
  // after the run, when the trace would be lost. Throws loom::IoError naming the path and the fix.
  static void prepare_trace_file(const std::string& path);

 private:
  static constexpr size_t kMaxEvents = 4'000'000;  // ~200 MB of JSON; later events are counted, not kept
  Mode mode_;
  int rank_;
  mutable std::mutex mu_;
  std::map<std::string, SpanStats> stats_;
  std::vector<Event> events_;
  std::vector<CounterSample> counters_;
  int64_t dropped_ = 0;
};

// RAII span. `tracer` may be null.
class Span {
 public:
  Span(Tracer* tracer, const char* name, Category category, double flops = 0, double bytes = 0)
      : tracer_(tracer && tracer->on() ? tracer : nullptr), name_(name), category_(category), flops_(flops),
        bytes_(bytes), start_(tracer_ ? Tracer::now_ns() : 0) {}
  ~Span() {
    if (tracer_) tracer_->record(name_, category_, start_, Tracer::now_ns(), flops_, bytes_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  // For work whose size is known only once it ran (the gradients a data-parallel strategy zeroed).
  void set_cost(double flops, double bytes) { flops_ = flops, bytes_ = bytes; }

 private:
  Tracer* tracer_;
  const char* name_;
  Category category_;
  double flops_, bytes_;
  int64_t start_;
};

// Where a run's time went: per-kernel rows and the GEMM / other-kernel / host split of `wall_seconds`.
struct TimeBreakdown {
  double wall_seconds = 0;
  double gemm_seconds = 0;
  double kernel_seconds = 0;
  double comm_seconds = 0;     // exposed: waited for
  double in_flight_seconds = 0;  // asynchronous collectives from issue to completion
  double async_wait_seconds = 0;  // of comm_seconds: the waits of those asynchronous collectives
  // Each asynchronous collective by name: seconds in flight and seconds waited for (its ".wait").
  struct InFlightRow {
    std::string name;
    double in_flight_seconds = 0, wait_seconds = 0;
  };
  std::vector<InFlightRow> in_flight;  // sorted by time in flight, descending
  double host_seconds = 0;  // wall minus everything traced
  std::vector<std::pair<std::string, SpanStats>> rows;  // sorted by time, descending
};
TimeBreakdown breakdown(const Tracer& tracer, double wall_seconds);
std::string format_breakdown(const TimeBreakdown& b, int max_rows = 16);

}  // namespace loom::profile
