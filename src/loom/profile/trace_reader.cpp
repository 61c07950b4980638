#include "loom/profile/trace_reader.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/error.h"

namespace loom::profile {

bool parse_category(const std::string& name, Category& out) {
  for (Category c : {Category::Gemm, Category::Kernel, Category::Communication, Category::Host, Category::Step,
                     Category::InFlight, Category::CommWork})
    if (name == category_name(c)) {
      out = c;
      return true;
    }
  return false;
}

std::vector<TraceSpan> parse_chrome_trace(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw IoError("'" + what + "' is not JSON (" + e.what() + "): give a trace Loom wrote (trace.file)");
  }
  if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array())
    throw IoError("'" + what + "' has no \"traceEvents\" array: it is not a Chrome trace (trace.file of a Loom run)");
  std::vector<TraceSpan> out;
  const auto& events = j["traceEvents"];
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (!e.is_object() || e.value("ph", "") != "X") continue;  // metadata records
    TraceSpan s;
    try {
      if (!parse_category(e.at("cat").get<std::string>(), s.category)) continue;
      s.name = e.at("name").get<std::string>();
      s.rank = e.at("pid").get<int>();
      s.thread = e.value("tid", 0);
      s.start_s = e.at("ts").get<double>() * 1e-6;
      s.duration_s = e.at("dur").get<double>() * 1e-6;
      if (e.contains("args") && e["args"].is_object()) {
        s.flops = e["args"].value("flops", 0.0);
        s.bytes = e["args"].value("bytes", 0.0);
        s.unit = e["args"].value("unit", SpanContext::kNoUnit);
        s.micro_batch = e["args"].value("micro_batch", -1);
        s.pass = e["args"].value("pass", std::string());
        s.group = e["args"].value("group", std::string());
        s.seq = e["args"].value("seq", int64_t{-1});
        s.peer = e["args"].value("peer", -1);
      }
    } catch (const nlohmann::json::exception& ex) {
      throw IoError("'" + what + "': event " + std::to_string(i) + " is malformed (" + ex.what() + ")");
    }
    if (s.duration_s < 0 || s.rank < 0)
      throw IoError("'" + what + "': event " + std::to_string(i) + " has a negative duration or rank");
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<TraceSpan> read_chrome_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot read trace '" + path + "': no such file, or not readable");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_chrome_trace(text.str(), path);
}

}  // namespace loom::profile
