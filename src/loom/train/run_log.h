// What a run leaves on disk: metrics.jsonl (one JSON object per step; schema in docs/metrics.md) and
// manifest.json (version, commit, machine, threads, resolved config), both under train.out_dir.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include "loom/train/run_config.h"
#include "loom/train/trainer.h"

namespace loom::train {

struct RunIdentity {
  std::string version, commit, backend;
  int threads = 0;
  double peak_flops = 0;
  std::string peak_source;
};

// Creates out_dir and writes manifest.json (atomically: temp file + rename). Throws IoError.
void write_run_manifest(const std::string& out_dir, const RunConfig& cfg, const RunIdentity& id);

class MetricsLog {
 public:
  // Opens out_dir/metrics.jsonl: appended to when resuming (the lines of the steps before the
  // checkpoint stay); for a new run, an earlier run's log is first renamed to metrics-<time>.jsonl.
  // Throws IoError naming the path.
  MetricsLog(const std::string& out_dir, bool append);
  void write(const StepMetrics& s);
  // Resuming from the checkpoint of `step`: the lines of later steps (a crashed attempt logged them
  // before it died; they run again) are removed, so every step appears once.
  void drop_after(int64_t step);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<FILE, int (*)(FILE*)> file_{nullptr, &std::fclose};
};

}  // namespace loom::train
