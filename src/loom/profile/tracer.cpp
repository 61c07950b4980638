#include "loom/profile/tracer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <system_error>

#include <unistd.h>

#include "loom/error.h"

namespace loom::profile {

const char* category_name(Category c) {
  switch (c) {
    case Category::Gemm: return "gemm";
    case Category::Kernel: return "kernel";
    case Category::Communication: return "comm";
    case Category::Host: return "host";
    case Category::Step: return "step";
    case Category::InFlight: return "comm_in_flight";
    case Category::CommWork: return "comm_work";
  }
  return "?";
}

SpanContext& span_context() {
  thread_local SpanContext c;
  return c;
}

int64_t Tracer::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Tracer::record(const char* name, Category category, int64_t start_ns, int64_t end_ns, double flops,
                    double bytes) {
  if (mode_ == Mode::Off) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto& s = stats_[name];
  s.category = category;
  s.calls += 1;
  s.seconds += static_cast<double>(end_ns - start_ns) * 1e-9;
  s.flops += flops;
  s.bytes += bytes;
  if (mode_ == Mode::Full) {
    if (events_.size() < kMaxEvents)
      events_.push_back({name, category, start_ns, end_ns - start_ns, flops, bytes, rank_, span_context()});
    else
      ++dropped_;
  }
}

void Tracer::counter(std::string name, std::vector<std::pair<std::string, double>> values) {
  if (mode_ != Mode::Full) return;
  const int64_t at = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() + counters_.size() < kMaxEvents)
    counters_.push_back({std::move(name), at, std::move(values)});
  else
    ++dropped_;
}

std::map<std::string, SpanStats> Tracer::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Tracer::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.clear();
}

size_t Tracer::event_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

std::string Tracer::chrome_events_json(int64_t origin_ns, int64_t clock_offset_ns) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = fmt::format(",\n{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{},\"args\":{{\"name\":\"rank {}\"}}}}",
                                rank_, rank_);
  for (auto& e : events_) {
    // Steps, GEMMs and other kernels on separate tracks keeps nesting readable in Perfetto.
    int tid = e.category == Category::Step            ? 0
              : e.category == Category::Communication ? 2
              : e.category == Category::CommWork      ? 3
                                                      : 1;
    // Where in the model and the step the span ran, when known.
    std::string where;
    if (e.context.unit != SpanContext::kNoUnit) where += fmt::format(",\"unit\":{}", e.context.unit);
    if (e.context.micro_batch >= 0) where += fmt::format(",\"micro_batch\":{}", e.context.micro_batch);
    if (e.context.pass) where += fmt::format(",\"pass\":\"{}\"", e.context.pass);
    if (e.context.group) where += fmt::format(",\"group\":\"{}\"", e.context.group);
    if (e.context.seq >= 0) where += fmt::format(",\"seq\":{}", e.context.seq);
    if (e.context.algorithm) where += fmt::format(",\"algorithm\":\"{}\"", e.context.algorithm);
    if (e.context.peer >= 0) where += fmt::format(",\"peer\":{}", e.context.peer);
    out += fmt::format(
        ",\n{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{:.3f},\"dur\":{:.3f},\"pid\":{},\"tid\":{},"
        "\"args\":{{\"flops\":{:.0f},\"bytes\":{:.0f}{}}}}}",
        e.name, category_name(e.category), static_cast<double>(e.start_ns - clock_offset_ns - origin_ns) * 1e-3,
        static_cast<double>(e.duration_ns) * 1e-3, e.rank, tid, e.flops, e.bytes, where);
  }
  for (auto& c : counters_) {
    std::string args;
    for (auto& [series, v] : c.values) args += fmt::format("{}\"{}\":{}", args.empty() ? "" : ",", series, v);
    out += fmt::format(",\n{{\"name\":\"{}\",\"ph\":\"C\",\"ts\":{:.3f},\"pid\":{},\"args\":{{{}}}}}", c.name,
                       static_cast<double>(c.at_ns - clock_offset_ns - origin_ns) * 1e-3, rank_, args);
  }
  return out;
}

std::optional<int64_t> Tracer::first_event_ns() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.empty()) return std::nullopt;
  int64_t t0 = events_.front().start_ns;
  for (auto& e : events_) t0 = std::min(t0, e.start_ns);
  return t0;
}

int64_t Tracer::dropped_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

void Tracer::write_chrome_trace_parts(const std::string& path, const std::vector<std::string>& parts, int64_t dropped) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "w"), &std::fclose);
  if (!f) throw IoError("cannot write trace file '" + path + "': check the directory exists and is writable");
  fmt::print(f.get(), "{{\"displayTimeUnit\":\"ms\",\"otherData\":{{\"dropped_events\":{}}},\"traceEvents\":[\n", dropped);
  // The first part starts with ",\n": an empty metadata record keeps the array well-formed.
  fmt::print(f.get(), "{{\"name\":\"loom\",\"ph\":\"M\",\"pid\":0,\"args\":{{}}}}");
  for (const auto& p : parts) std::fwrite(p.data(), 1, p.size(), f.get());
  fmt::print(f.get(), "\n]}}\n");
  if (std::ferror(f.get())) throw IoError("error writing trace file '" + path + "' (disk full?)");
}

void Tracer::prepare_trace_file(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const std::string fix = "; give a trace path in a writable folder";
  if (file.filename().empty())
    throw IoError("trace file '" + path + "' names a folder: give a file name, e.g. " + (file / "trace.json").string());
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir, ec))
    throw IoError("cannot create the folder '" + dir.string() + "' for the trace file '" + path + "'" +
                  (ec ? " (" + ec.message() + ")" : std::string()) + fix);
  const fs::file_status st = fs::status(file, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw IoError("cannot check the trace file '" + path + "' (" + ec.message() + ")" + fix);
  if (fs::is_directory(st))
    throw IoError("trace file '" + path + "' is a folder: give a file name, e.g. " + (file / "trace.json").string());
  // access() rather than opening the file: an existing trace is only replaced once the run has one.
  const bool exists = fs::exists(st);
  const bool writable = exists ? ::access(file.c_str(), W_OK) == 0 : ::access(dir.c_str(), W_OK | X_OK) == 0;
  if (!writable)
    throw IoError("cannot write the trace file '" + path + "': " +
                  (exists ? "the file is read-only" : "the folder '" + dir.string() + "' is not writable") + fix);
}

void Tracer::write_chrome_trace(const std::string& path) const {
  write_chrome_trace_parts(path, {chrome_events_json(first_event_ns().value_or(0), 0)}, dropped_events());
}

TimeBreakdown breakdown(const Tracer& tracer, double wall_seconds) {
  TimeBreakdown b;
  b.wall_seconds = wall_seconds;
  const auto stats = tracer.stats();
  for (auto& [name, s] : stats) {
    if (s.category == Category::InFlight) {
      b.in_flight_seconds += s.seconds;
      TimeBreakdown::InFlightRow row{name, s.seconds, 0};
      if (auto w = stats.find(name + ".wait"); w != stats.end()) row.wait_seconds = w->second.seconds;
      b.async_wait_seconds += row.wait_seconds;
      b.in_flight.push_back(row);
    }
    if (s.category == Category::Step || s.category == Category::Host || s.category == Category::InFlight) continue;
    if (s.category == Category::Gemm) b.gemm_seconds += s.seconds;
    if (s.category == Category::Kernel) b.kernel_seconds += s.seconds;
    if (s.category == Category::Communication) b.comm_seconds += s.seconds;
    b.rows.emplace_back(name, s);
  }
  b.host_seconds = std::max(0.0, wall_seconds - b.gemm_seconds - b.kernel_seconds - b.comm_seconds);
  std::sort(b.rows.begin(), b.rows.end(), [](auto& x, auto& y) { return x.second.seconds > y.second.seconds; });
  std::sort(b.in_flight.begin(), b.in_flight.end(),
            [](auto& x, auto& y) { return x.in_flight_seconds > y.in_flight_seconds; });
  return b;
}

std::string format_breakdown(const TimeBreakdown& b, int max_rows) {
  auto pct = [&](double s) { return b.wall_seconds > 0 ? 100.0 * s / b.wall_seconds : 0.0; };
  std::string out = fmt::format("{:<28} {:>8} {:>10} {:>7} {:>10} {:>9}\n", "span", "calls", "time ms", "share",
                                "GFLOP/s", "GB/s");
  int n = 0;
  for (auto& [name, s] : b.rows) {
    if (n++ >= max_rows) break;
    out += fmt::format("{:<28} {:>8} {:>10.1f} {:>6.1f}% {:>10.1f} {:>9.1f}\n", name, s.calls, s.seconds * 1e3,
                       pct(s.seconds), s.seconds > 0 ? s.flops / s.seconds * 1e-9 : 0.0,
                       s.seconds > 0 ? s.bytes / s.seconds * 1e-9 : 0.0);
  }
  out += fmt::format("split: gemm {:.1f}%  other kernels {:.1f}%  communication {:.1f}%  host {:.1f}%  (wall {:.2f} s)",
                     pct(b.gemm_seconds), pct(b.kernel_seconds), pct(b.comm_seconds), pct(b.host_seconds),
                     b.wall_seconds);
  if (b.in_flight_seconds > 0)
    out += fmt::format("\nasynchronous collectives: {:.1f}% of the wall in flight, of it {:.1f}% hidden under compute",
                       pct(b.in_flight_seconds),
                       100.0 * std::max(0.0, b.in_flight_seconds - b.async_wait_seconds) / b.in_flight_seconds);
  // Per collective where there are several kinds (e.g. the context-parallel ring's K/V under attention).
  for (size_t i = 0; b.in_flight.size() > 1 && i < b.in_flight.size() && static_cast<int>(i) < max_rows; ++i) {
    const auto& r = b.in_flight[i];
    if (r.in_flight_seconds <= 0) continue;
    out += fmt::format("\n  {:<26} {:>10.1f} ms in flight, {:.1f}% hidden", r.name, r.in_flight_seconds * 1e3,
                       100.0 * std::max(0.0, r.in_flight_seconds - r.wait_seconds) / r.in_flight_seconds);
  }
  return out;
}

}  // namespace loom::profile
