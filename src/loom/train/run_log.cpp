#include "loom/train/run_log.h"

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/file_reader.h"

#include "loom/error.h"

namespace loom::train {

namespace fs = std::filesystem;

void write_run_manifest(const std::string& out_dir, const RunConfig& cfg, const RunIdentity& id) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw IoError("cannot create train.out_dir '" + out_dir + "': " + ec.message());
  nlohmann::json j;
  j["loom_version"] = id.version;
  j["commit"] = id.commit;
  j["backend"] = id.backend;
  j["threads"] = id.threads;
  j["peak_flops"] = id.peak_flops;
  j["peak_source"] = id.peak_source;
  j["precision"] = cfg.precision_label();
  j["model_flops_per_token"] = spec::model_flops_per_token(cfg.model.resolved, cfg.seq_len());
  j["started_unix"] = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  j["config_toml"] = cfg.to_toml();
  fs::path path = fs::path(out_dir) / "manifest.json", tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    if (!out) throw IoError("cannot write '" + tmp.string() + "' (disk full or read-only?)");
  }
  fs::rename(tmp, path, ec);
  if (ec) throw IoError("cannot rename '" + tmp.string() + "' to '" + path.string() + "': " + ec.message());
}

MetricsLog::MetricsLog(const std::string& out_dir, bool append)
    : path_((fs::path(out_dir) / "metrics.jsonl").string()) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  // A new run never overwrites an earlier run's log: it is kept beside, named by its last write time
  // (UTC), with a counter when two runs ended within the same second. (The time was the file clock's
  // count, not Unix time -- a negative number -- and a second log of the same second replaced the first.)
  if (!append && fs::file_size(path_, ec) > 0 && !ec) {
    const auto written = std::chrono::floor<std::chrono::seconds>(
        std::chrono::file_clock::to_sys(fs::last_write_time(path_)));
    const std::time_t t = std::chrono::system_clock::to_time_t(written);
    std::tm utc{};
    gmtime_r(&t, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &utc);
    fs::path kept = fs::path(out_dir) / ("metrics-" + std::string(stamp) + ".jsonl");
    for (int n = 2; fs::exists(kept); ++n)
      kept = fs::path(out_dir) / ("metrics-" + std::string(stamp) + "-" + std::to_string(n) + ".jsonl");
    fs::rename(path_, kept, ec);
    if (ec) throw IoError("cannot keep the earlier log '" + path_ + "' as '" + kept.string() + "': " + ec.message());
  }
  file_.reset(std::fopen(path_.c_str(), append ? "a" : "w"));
  if (!file_) throw IoError("cannot write metrics log '" + path_ + "': check train.out_dir is writable");
}

void MetricsLog::drop_after(int64_t step) {
  const std::string text = read_file(path_);
  std::istringstream in(text);
  std::string kept, line;
  // A last line without its newline (a crash mid-write) is rewritten too, or the next record would be
  // glued onto it.
  bool dropped = !text.empty() && text.back() != '\n';
  while (std::getline(in, line)) {
    // A line cut short by a crash is dropped with the steps after the checkpoint.
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step)
      kept += line + "\n";
    else
      dropped = true;
  }
  if (!dropped) return;
  file_.reset();
  const fs::path tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    if (!out) throw IoError("cannot write '" + tmp.string() + "' (disk full or read-only?)");
  }
  std::error_code ec;
  fs::rename(tmp, path_, ec);
  if (ec) throw IoError("cannot rename '" + tmp.string() + "' to '" + path_ + "': " + ec.message());
  file_.reset(std::fopen(path_.c_str(), "a"));
  if (!file_) throw IoError("cannot write metrics log '" + path_ + "': check train.out_dir is writable");
}

void MetricsLog::write(const StepMetrics& s) {
  nlohmann::json j{{"step", s.step},           {"loss", s.loss},
                   {"lr", s.lr},               {"grad_norm", s.grad_norm},
                   {"step_s", s.step_seconds}, {"tokens_per_s", s.tokens_per_s},
                   {"mfu", s.mfu},             {"tokens", s.tokens},
                   {"elapsed_s", s.elapsed_seconds}};
  if (s.val_loss) j["val_loss"] = *s.val_loss;
  if (s.skipped) {
    j["skipped"] = true;
    j["skip_reason"] = s.skip_reason;
  }
  if (s.skipped_steps > 0) j["skipped_steps"] = s.skipped_steps;
  if (s.fp8) {
    j["fp8_overflow"] = s.fp8_overflow;
    j["fp8_underflow"] = s.fp8_underflow;
    // Per tensor with any: [saturated, flushed to zero], e.g. "layers.3.up.output_grad": [0, 1234].
    nlohmann::json per = nlohmann::json::object();
    for (const auto& t : s.fp8_tensors) per[t.name] = {t.overflow, t.underflow};
    j["fp8_tensors"] = per;
  }
  if (!s.moe.empty()) {
    // Per mixture-of-experts block: tokens per expert, dropped, max/mean and the load-balancing loss.
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : s.moe)
      blocks.push_back({{"layer", b.layer}, {"tokens_per_expert", b.routed}, {"dropped", b.dropped},
                        {"imbalance", b.imbalance}, {"aux_loss", b.aux_loss}});
    j["moe"] = blocks;
  }
  if (s.exposed_comm_seconds > 0 || s.comm_cpu_seconds > 0) {
    j["exposed_comm_s"] = s.exposed_comm_seconds;
    j["comm_cpu_s"] = s.comm_cpu_seconds;
  }
  if (!s.pipeline_idle.empty()) {
    j["pp_idle"] = s.pipeline_idle;
    j["pp_bubble_theory"] = s.pipeline_bubble_theory;
  }
  std::string line = j.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_.get());
  std::fflush(file_.get());
}

}  // namespace loom::train
