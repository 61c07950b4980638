#include "loom/train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "loom/core/checksum.h"
#include "loom/core/file_writer.h"
#include "loom/core/safetensors.h"
#include "loom/error.h"
#include "loom/train/checkpoint_manifest.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Crash injection for the tests that kill a save at each phase: LOOM_FAULT_INJECT=<phase> or
// bytes:<N> ends the process on the spot (like SIGKILL: no unwinding, no cleanup).
void fault_point(const char* phase) {
  static const char* spec = std::getenv("LOOM_FAULT_INJECT");
  if (spec && std::string(spec) == phase) std::_Exit(86);
}
uint64_t fault_byte_limit() {
  const char* spec = std::getenv("LOOM_FAULT_INJECT");
  if (spec && std::string(spec).rfind("bytes:", 0) == 0) return std::strtoull(spec + 6, nullptr, 10);
  return 0;
}

std::string step_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::string new_run_id() {
  std::random_device rd;
  auto now = std::chrono::system_clock::now().time_since_epoch().count();
  return fmt::format("{:x}-{:x}-{:08x}", static_cast<uint64_t>(now), ::getpid(), rd());
}

bool holds_checkpoints(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (fs::exists(dir / "latest")) return true;
  for (auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("step-", 0) == 0) return true;
  return false;
}

}  // namespace

CheckpointManager::CheckpointManager(std::string dir, int64_t keep, bool resuming) : dir_(std::move(dir)), keep_(keep) {
  // The folder is created by the first save: a run that never saves leaves nothing behind.
  std::error_code ec;
  if (resuming) {
    if (auto l = newest_complete_checkpoint(dir_)) run_id_ = read_checkpoint_manifest(*l).run_id;
  } else if (holds_checkpoints(dir_)) {
    throw ConfigError("checkpoint.dir '" + dir_ + "' already holds checkpoints of another run; pass --resume to " +
                      "continue that run, or choose another --save-dir (nothing was overwritten)");
  }
  if (run_id_.empty()) run_id_ = new_run_id();
  // Folders of saves that crashed half way: never a checkpoint, safe to remove.
  for (auto& e : fs::directory_iterator(dir_, ec))
    if (e.path().filename().string().rfind(".tmp-", 0) == 0) fs::remove_all(e.path(), ec);
}

std::optional<std::string> CheckpointManager::latest() const { return latest_in(dir_); }

std::optional<std::string> CheckpointManager::latest_in(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "latest");
  std::string name;
  if (!(in >> name)) return std::nullopt;
  return (fs::path(dir) / name).string();
}

std::optional<std::string> newest_complete_checkpoint(const std::string& dir) {
  std::optional<std::string> run;
  if (auto l = CheckpointManager::latest_in(dir)) {
    try {
      run = read_checkpoint_manifest(*l).run_id;
    } catch (const Error&) {
      // `latest` names a damaged folder: any complete one will do.
    }
  }
  std::optional<std::pair<int64_t, std::string>> best;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename().string().rfind("step-", 0) != 0) continue;
    try {
      const auto m = read_checkpoint_manifest(e.path().string());
      if (run && m.run_id != *run) continue;
      if (!best || m.step > best->first) best = {m.step, e.path().string()};
    } catch (const Error&) {
      // Damaged or foreign: never a checkpoint to continue from.
    }
  }
  if (!best) return std::nullopt;
  return best->second;
}

CheckpointImage CheckpointManager::capture(Trainer& t, int64_t step, Tensor* copy_into, Allocator* alloc) const {
  CheckpointImage img;
  img.step = step;
  const auto moments = t.full_moments();
  const float* master = t.full_master();
  const auto& params = t.full_table().params();
  // An asynchronous save copies the state first: training goes on changing the trainer's.
  const float *m = moments.m, *v = moments.v;
  if (copy_into) {
    const int64_t n = t.full_table().total_numel();
    if (!copy_into->defined() || copy_into->numel() != 3 * n) {
      if (!alloc) throw Error("internal: a checkpoint copy needs an allocator");
      *copy_into = Tensor::empty({3 * n}, DType::F32, *alloc, MemCategory::Workspace);
    }
    img.owned = *copy_into;
    float* dst = img.owned.data<float>();
    std::memcpy(dst, master, static_cast<size_t>(n) * sizeof(float));
    std::memcpy(dst + n, moments.m, static_cast<size_t>(n) * sizeof(float));
    std::memcpy(dst + 2 * n, moments.v, static_cast<size_t>(n) * sizeof(float));
    master = dst, m = dst + n, v = dst + 2 * n;
  }
  // One entry per tensor: the model file holds masters by parameter name, the optimizer file
  // "exp_avg.<name>" / "exp_avg_sq.<name>" (PyTorch's AdamW state names).
  for (const auto& p : params) {
    auto add = [&](std::vector<SafetensorsEntry>& file, const char* file_name, const std::string& key, const float* data) {
      file.push_back({key, DType::F32, p.shape, data, static_cast<size_t>(p.numel()) * sizeof(float)});
      img.index.push_back({{"name", key}, {"param", p.name}, {"file", file_name}, {"dtype", "F32"}, {"shape", p.shape},
                           {"placement", p.placement.str()}});
    };
    add(img.model, "model.safetensors", p.name, master + p.offset);
    add(img.optimizer, "optimizer.safetensors", "exp_avg." + p.name, m + p.offset);
    add(img.optimizer, "optimizer.safetensors", "exp_avg_sq." + p.name, v + p.offset);
  }
  const auto& data = t.data();
  img.tokenizer_file = data.tokenizer_file();
  img.tokenizer_hash = data.tokenizer_hash();
  const auto& cfg = t.config();
  img.facts = {{"world", {{"ranks", cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp},
                          {"layout", {{"dp", cfg.parallel.dp}, {"tp", cfg.parallel.tp}, {"pp", cfg.parallel.pp},
                                      {"cp", cfg.parallel.cp}, {"ep", cfg.parallel.ep}, {"zero", cfg.parallel.zero}}}}},
               {"optimizer", {{"type", "adamw"}, {"steps", t.optimizer().steps_taken()}}},
               {"schedule", {{"step", step}}},
               {"data", {{"source", cfg.data.source}, {"seed", cfg.train.seed},
                         {"next_sample", step * cfg.train.batch_size}}},
               {"config_toml", cfg.to_toml()}};
  return img;
}

std::string CheckpointManager::save(Trainer& trainer, int64_t step) { return write(capture(trainer, step)); }

std::string CheckpointManager::write(const CheckpointImage& img) {
  const fs::path dir(dir_);
  const std::string name = step_name(img.step);
  const fs::path tmp = dir / (".tmp-" + name + "-" + std::to_string(::getpid()));
  const fs::path final_path = dir / name;
  auto previous = latest();
  try {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw IoError("cannot create checkpoint.dir '" + dir_ + "': " + ec.message());
    fs::remove_all(tmp, ec);
    if (!fs::create_directory(tmp, ec)) throw IoError("cannot create '" + tmp.string() + "': " + ec.message());
    SafetensorsWriteOptions opts;
    opts.sync = true;
    if (uint64_t limit = fault_byte_limit())
      opts.on_progress = [limit](uint64_t n) {
        if (n >= limit) std::_Exit(86);
      };
    write_safetensors((tmp / "model.safetensors").string(), img.model, {{"format", "pt"}}, opts);
    fault_point("tensor_data");
    write_safetensors((tmp / "optimizer.safetensors").string(), img.optimizer, {}, opts);

    json tokenizer = nullptr;
    if (!img.tokenizer_file.empty()) {
      fs::copy_file(img.tokenizer_file, tmp / "tokenizer.model", fs::copy_options::overwrite_existing, ec);
      if (ec) throw IoError("cannot copy the tokenizer '" + img.tokenizer_file + "': " + ec.message());
      tokenizer = {{"file", "tokenizer.model"}, {"hash", img.tokenizer_hash}};
    }
    // Every tensor's checksum, in the index's order (model, exp_avg, exp_avg_sq per parameter).
    json index = img.index;
    for (size_t i = 0; i < index.size(); ++i) {
      const SafetensorsEntry& e = i % 3 == 0 ? img.model[i / 3] : img.optimizer[2 * (i / 3) + (i % 3) - 1];
      index[i]["checksum"] = checksum_hex(checksum64(e.data, e.nbytes));
    }
    json manifest{{"format", kCheckpointFormat},
                  {"version", kCheckpointVersion},
                  {"step", img.step},
                  {"run_id", run_id_},
                  {"created_unix", std::chrono::duration_cast<std::chrono::seconds>(
                                       std::chrono::system_clock::now().time_since_epoch()).count()}};
    // Whole tensors whatever the layout: what the run was trained with, for the record.
    for (const auto& [k, v] : img.facts.items()) manifest[k] = v;
    manifest["tokenizer"] = tokenizer;
    manifest["tensors"] = index;
    fault_point("manifest");
    {
      std::string text = manifest.dump(1);
      FileWriter w((tmp / "manifest.json").string());
      w.write(text.data(), text.size());
      w.sync();
      w.close();
    }
    fsync_directory(tmp.string());
    fault_point("fsync");
    fs::remove_all(final_path, ec);  // a stale folder of the same step (never `latest`)
    fault_point("rename");
    fs::rename(tmp, final_path, ec);
    if (ec) throw IoError("cannot rename '" + tmp.string() + "' to '" + final_path.string() + "': " + ec.message());
    fsync_directory(dir.string());
    fault_point("latest");
    write_file_atomically((dir / "latest").string(), name + "\n");
  } catch (const Error& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw IoError(std::string("saving the checkpoint of step ") + std::to_string(img.step) + " failed: " + e.what() +
                  (previous ? "; the previous checkpoint '" + *previous + "' is intact" : "; no earlier checkpoint exists"));
  }
  prune(final_path.string());
  return final_path.string();
}

void CheckpointManager::prune(const std::string& just_saved) {
  if (keep_ <= 0) return;
  std::vector<fs::path> ours;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir_, ec)) {
    if (e.path().filename().string().rfind("step-", 0) != 0) continue;
    try {
      if (read_checkpoint_manifest(e.path().string()).run_id == run_id_) ours.push_back(e.path());
    } catch (const Error&) {
      // Not ours to judge: a damaged or foreign folder is left alone.
    }
  }
  std::sort(ours.begin(), ours.end());  // zero-padded step numbers sort by step
  for (size_t i = 0; i + static_cast<size_t>(keep_) < ours.size(); ++i)
    if (ours[i].string() != just_saved) fs::remove_all(ours[i], ec);
}

namespace {

// Copies the part of a parameter's checkpoint tensor `src` that lies inside arena range `r` to `dst`,
// where dst[0] holds arena element r.begin.
void copy_overlap(float* dst, const spec::ArenaRange& r, const spec::ParamSpec& p, const void* src) {
  const int64_t a = std::max(p.offset, r.begin), b = std::min(p.offset + p.numel(), r.end);
  if (a < b)
    std::memcpy(dst + (a - r.begin), static_cast<const float*>(src) + (a - p.offset), static_cast<size_t>(b - a) * sizeof(float));
}

// A checkpoint holds whole tensors; a tensor-parallel rank reads its shard of one (padding: zeros).
// Returns `whole` itself for a whole-model table, else the shard cut into `buffer`.
const void* shard_of(const void* whole, const spec::ParamSpec& p, const spec::ParamTable& table,
                     std::vector<float>& buffer) {
  if (table.shard().whole()) return whole;
  buffer.assign(static_cast<size_t>(p.numel()), 0.0f);
  const float* src = static_cast<const float*>(whole);
  for (int64_t i = 0; i < p.numel(); ++i)
    if (const int64_t g = table.global_element(p, i); g >= 0) buffer[static_cast<size_t>(i)] = src[g];
  return buffer.data();
}

// Copies every tensor the manifest lists into the parameter (and, when given, optimizer) arenas,
// verifying shape and checksum first; a damaged tensor is named and nothing is half-trusted.
// weights_kept: the arena ranges whose weights this rank holds (a ZeRO-3 shard); empty means all.
void load_tensors(const fs::path& dir, const CheckpointManifest& m, model::ParameterStore& params, AdamW* adam,
                  std::span<const spec::ArenaRange> weights_kept = {}) {
  SafetensorsFile model((dir / "model.safetensors").string());
  std::optional<SafetensorsFile> opt;
  if (adam) opt.emplace((dir / "optimizer.safetensors").string());
  size_t model_tensors = 0, optimizer_tensors = 0;
  std::vector<float> shard;  // this rank's part of the tensor being read
  for (const auto& entry : m.tensors) {
    const std::string& key = entry.name;
    const bool is_model = entry.model;
    if (!is_model && !adam) continue;
    if (!params.table().index_of(entry.param)) continue;  // another pipeline stage's
    model_tensors += is_model;
    optimizer_tensors += !is_model;
    const auto& spec = params.table().at(entry.param);
    const auto& e = is_model ? model.at(key) : opt->at(key);
    if (e.dtype != DType::F32 || e.shape != spec.global_shape)
      throw IoError("checkpoint tensor '" + key + "' has shape " + json(e.shape).dump() + ", the model expects " +
                    json(spec.global_shape).dump());
    if (checksum_hex(checksum64(e.data, e.nbytes)) != entry.checksum)
      throw IoError("checkpoint '" + dir.string() + "': tensor '" + key +
                    "' is corrupted (checksum mismatch); resume from an earlier checkpoint");
    const void* data = shard_of(e.data, spec, params.table(), shard);
    if (is_model) {
      if (weights_kept.empty())
        std::memcpy(params.master().data<float>() + spec.offset, data, static_cast<size_t>(spec.numel()) * sizeof(float));
      for (const auto& r : weights_kept) copy_overlap(params.master().data<float>() + r.begin, r, spec, data);
      continue;
    }
    // Moments: only the parts inside this rank's optimizer pieces (all of it without ZeRO).
    float* local = key.rfind("exp_avg_sq.", 0) == 0 ? adam->v().data<float>() : adam->m().data<float>();
    for (size_t k = 0; k < adam->pieces().size(); ++k)
      copy_overlap(local + adam->local_offset(k), adam->pieces()[k], spec, data);
  }
  if (model_tensors != params.table().params().size())
    throw IoError("checkpoint '" + dir.string() + "' holds " + std::to_string(model_tensors) +
                  " weight tensors; this model needs " + std::to_string(params.table().params().size()));
  if (adam && optimizer_tensors != 2 * params.table().params().size())
    throw IoError("checkpoint '" + dir.string() + "' holds " + std::to_string(optimizer_tensors) +
                  " optimizer tensors; AdamW needs two per parameter");
}

}  // namespace

RunConfig checkpoint_config(const std::string& path) {
  const fs::path dir = resolve_checkpoint(path);
  return parse_run_config(read_checkpoint_manifest(dir.string()).config_toml, dir.string() + "/manifest.json");
}

std::string checkpoint_tokenizer(const std::string& path) {
  const fs::path dir = resolve_checkpoint(path);
  const auto m = read_checkpoint_manifest(dir.string());
  return m.tokenizer ? (dir / m.tokenizer->file).string() : "";
}

void load_model_weights(const std::string& path, model::ParameterStore& params) {
  const fs::path dir = resolve_checkpoint(path);
  load_tensors(dir, read_checkpoint_manifest(dir.string()), params, nullptr);
  params.refresh_lowp();
}

std::string resolve_checkpoint(const std::string& path) {
  fs::path p(path);
  if (fs::exists(p / "manifest.json")) return p.string();
  std::ifstream in(p / "latest");
  std::string name;
  if (in >> name && fs::exists(p / name / "manifest.json")) return (p / name).string();
  throw IoError("no checkpoint at '" + path + "': expected a step-N folder with manifest.json, or a checkpoint dir " +
                "whose `latest` names one");
}

ResumeReport load_checkpoint(const std::string& path, Trainer& trainer) {
  const fs::path dir = resolve_checkpoint(path);
  const CheckpointManifest m = read_checkpoint_manifest(dir.string());
  if (m.version != kCheckpointVersion)
    throw IoError("'" + dir.string() + "' is a Loom checkpoint of version " + std::to_string(m.version) +
                  "; this build reads version " + std::to_string(kCheckpointVersion));
  const auto& cfg = trainer.config();
  RunConfig saved = parse_run_config(m.config_toml, dir.string() + "/manifest.json");
  ResumeReport report;
  // The model and layout must match exactly: tensors are read by name and shape.
  if (saved.model.resolved.arch != cfg.model.resolved.arch || saved.to_toml() != cfg.to_toml()) {
    std::istringstream a(saved.to_toml()), b(cfg.to_toml());
    std::string la, lb, section;
    while (std::getline(a, la) && std::getline(b, lb)) {
      if (!la.empty() && la[0] == '[') section = la.substr(1, la.size() - 2) + ".";
      if (la == lb) continue;
      std::string key = section + la.substr(0, la.find(' '));
      // Every layout saves whole tensors (rank 0's replica, ZeRO pieces, tp shards and pipeline stages
      // gathered), so dp, tp, pp, zero, the pipeline's schedule and cut and the bucket size may change on
      // resume; a different model, or an axis this build does not reshard yet (cp, ep), may not.
      const bool free_layout_key = key == "parallel.dp" || key == "parallel.tp" || key == "parallel.pp" ||
                                   key == "parallel.zero" || key == "parallel.bucket_kb" ||
                                   key == "parallel.sequence_parallel" || key == "parallel.tp_overlap" ||
                                   key.rfind("parallel.pipeline.", 0) == 0;
      if (section == "model." || (section == "parallel." && !free_layout_key))
        throw ConfigError("checkpoint '" + dir.string() + "' was made with " + key + " = " + la.substr(la.find('=') + 2) +
                          ", this run has " + lb.substr(lb.find('=') + 2) + "; resume with the checkpoint's model and layout");
      // Keys that shape the trajectory; where logs go or how often they print does not matter.
      static const std::vector<std::string> trajectory = {"precision", "train.seed", "train.steps", "train.batch_size",
          "train.micro_batch_size", "train.seq_len", "train.lr", "train.min_lr", "train.warmup_steps", "train.beta1",
          "train.beta2", "train.eps", "train.weight_decay", "train.grad_clip", "data.source", "data.dir"};
      if (std::find(trajectory.begin(), trajectory.end(), key) != trajectory.end()) report.changed_keys.push_back(key);
    }
  }
  const auto& data = trainer.data();
  if (m.tokenizer && m.tokenizer->hash != data.tokenizer_hash())
    throw ConfigError("checkpoint '" + dir.string() + "' was trained with tokenizer " + m.tokenizer->hash +
                      ", but the data now uses " + (data.tokenizer_hash().empty() ? "none" : data.tokenizer_hash()) +
                      "; resume on data prepared with the checkpoint's tokenizer");

  auto& params = trainer.params();
  auto& adam = trainer.optimizer();
  load_tensors(dir, m, params, &adam, trainer.weights_held());
  // The update count first: under bf16-sr the refreshed bf16 copies are keyed by it.
  adam.restore_steps(m.optimizer_steps);
  trainer.weights_changed();
  report.step = m.step;
  trainer.set_start_step(report.step);
  return report;
}

}  // namespace loom::train
