#include "loom/train/checkpoint.h"

#include "loom/kernels/elementwise.h"
#include "loom/model/fp8_recipe.h"

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
#include <map>
#include <memory>
#include <random>
#include <unordered_set>
#include <thread>
#include <unordered_map>

#include "loom/comm/collective.h"
#include "loom/core/checksum.h"
#include "loom/core/file_reader.h"
#include "loom/core/file_writer.h"
#include "loom/core/output_folder.h"
#include "loom/core/safetensors.h"
#include "loom/error.h"
#include "loom/kernels/elementwise.h"
#include "loom/train/checkpoint_manifest.h"
#include "loom/train/checkpoint_reader.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Crash injection for the tests that kill a save at each phase: LOOM_FAULT_INJECT=<phase> or
// bytes:<N> ends the process on the spot (like SIGKILL: no unwinding, no cleanup); with
// LOOM_FAULT_INJECT_RANK=<r>, only on that rank.
bool fault_rank(int rank) {
  static const char* only = std::getenv("LOOM_FAULT_INJECT_RANK");
  return !only || std::atoi(only) == rank;
}
uint64_t fault_byte_limit(int rank) {
  const char* spec = std::getenv("LOOM_FAULT_INJECT");
  if (spec && fault_rank(rank) && std::string(spec).rfind("bytes:", 0) == 0) return std::strtoull(spec + 6, nullptr, 10);
  return 0;
}

std::string part_name(int rank) { return fmt::format("part-rank{:05d}.json", rank); }
std::string failed_name(int rank) { return fmt::format("failed-rank{:05d}.txt", rank); }

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

void CheckpointManager::fault_point(const char* phase) const {
  static const char* spec = std::getenv("LOOM_FAULT_INJECT");
  if (spec && std::string(spec) == phase && fault_rank(rank_)) std::_Exit(86);
}

CheckpointManager::CheckpointManager(std::string dir, int64_t keep, bool resuming, int rank, int ranks)
    : dir_(std::move(dir)), keep_(keep), rank_(rank), ranks_(ranks) {
  // The folder is created by the first save: a run that never saves leaves nothing behind. Whether it
  // can be is checked now: a save that fails after the run's first hours loses them.
  check_output_folder(dir_, "checkpoint.dir (--save-dir)");
  std::error_code ec;
  if (resuming) {
    if (auto l = newest_complete_checkpoint(dir_)) run_id_ = read_checkpoint_manifest(*l).run_id;
  } else if (holds_checkpoints(dir_)) {
    // Said for every writer (train, import, ckpt convert): not only train has --resume and --save-dir.
    throw ConfigError("checkpoint folder '" + dir_ + "' already holds checkpoints of another run (nothing was " +
                      "overwritten): write into another folder (train: --save-dir, import: --out), or continue " +
                      "that run with `loom train --resume`");
  }
  if (run_id_.empty()) run_id_ = new_run_id();
  // Folders of saves that crashed half way: never a checkpoint, safe to remove (by rank 0 alone: the
  // others may already be writing a part into this run's).
  if (rank_ != 0) return;
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

namespace {

// What a manifest records besides the tensors: the layout saved from, the whole model's tensors (which the
// pieces of all ranks must cover), the optimizer, schedule and data positions, and the resolved config.
json checkpoint_facts(Trainer& t, int64_t step) {
  const auto& cfg = t.config();
  const int64_t ranks = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp;
  json params = json::array();
  const spec::ParamTable whole_model = spec::build_param_table(cfg.model.resolved);
  for (const auto& p : whole_model.params())
    params.push_back({{"name", p.name}, {"shape", p.shape}, {"placement", p.placement.str()}});
  return {{"world", {{"ranks", ranks},
                     {"layout", {{"dp", cfg.parallel.dp}, {"tp", cfg.parallel.tp}, {"pp", cfg.parallel.pp},
                                 {"cp", cfg.parallel.cp}, {"ep", cfg.parallel.ep}, {"zero", cfg.parallel.zero}}}}},
          {"ranks", ranks},
          {"params", params},
          {"optimizer", {{"type", "adamw"}, {"steps", t.optimizer().steps_taken()}}},
          {"schedule", {{"step", step}}},
          {"data", {{"source", cfg.data.source}, {"seed", cfg.train.seed}, {"next_sample", step * cfg.train.batch_size}}},
          {"config_toml", cfg.to_toml()}};
}

// precision = "fp8": the scaling state every rank holds alike (amaxes are reduced over all ranks).
void add_fp8_state(nlohmann::json& facts, const Trainer& t) {
  if (!t.fp8()) return;
  json history = json::object();
  for (const auto& [name, values] : t.fp8()->histories()) history[name] = values;
  facts["fp8"] = {{"recipe", model::fp8_scaling_name(t.fp8()->config().recipe)}, {"amax_history", history}};
}

}  // namespace

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
      const char* role = file_name[0] == 'm' ? "weight" : key.rfind("exp_avg_sq.", 0) == 0 ? "exp_avg_sq" : "exp_avg";
      img.index.push_back({{"name", key}, {"param", p.name}, {"file", file_name}, {"role", role}, {"dtype", "F32"}, {"shape", p.shape},
                           {"placement", p.placement.str()}});
    };
    add(img.model, "model.safetensors", p.name, master + p.offset);
    add(img.optimizer, "optimizer.safetensors", "exp_avg." + p.name, m + p.offset);
    add(img.optimizer, "optimizer.safetensors", "exp_avg_sq." + p.name, v + p.offset);
  }
  const auto& data = t.data();
  img.tokenizer_file = data.tokenizer_file();
  img.tokenizer_hash = data.tokenizer_hash();
  img.facts = checkpoint_facts(t, step);
  add_fp8_state(img.facts, t);
  img.facts["ranks"] = 1;  // rank 0 alone writes the gathered tensors
  return img;
}

namespace {

nlohmann::json runs_json(const std::vector<PieceRun>& runs) {
  json out = json::array();
  for (const auto& r : runs) out.push_back({r.global, r.length, r.stride, r.count});
  return out;
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void add_piece(CheckpointImage& img, const spec::ParamSpec& p, const SavePiece& piece, const float* const data[3],
               std::unordered_map<std::string, int>& seen) {
  const int64_t n = piece.end - piece.begin;
  // A piece that is the whole tensor keeps the tensor's shape and plain name (what one rank alone, and
  // a pipeline stage's whole tensors, write): those files read like the whole format's.
  const bool whole = piece.runs.size() == 1 && piece.runs[0].global == 0 && n == product(p.global_shape);
  const std::vector<int64_t> shape = whole ? p.global_shape : std::vector<int64_t>{n};
  const int k = seen[p.name]++;
  const std::string key = k == 0 ? p.name : fmt::format("{}@{}", p.name, piece.begin - p.offset);
  auto add = [&](std::vector<SafetensorsEntry>& file, const std::string& file_name, TensorRole role,
                 const std::string& name, const float* values) {
    file.push_back({name, DType::F32, shape, values, static_cast<size_t>(n) * sizeof(float)});
    img.index.push_back({{"name", name}, {"param", p.name}, {"file", file_name}, {"role", role_name(role)},
                         {"dtype", "F32"}, {"shape", shape}, {"runs", runs_json(piece.runs)}});
  };
  add(img.model, img.model_file, TensorRole::Weight, key, data[0]);
  add(img.optimizer, img.optimizer_file, TensorRole::ExpAvg, "exp_avg." + key, data[1]);
  add(img.optimizer, img.optimizer_file, TensorRole::ExpAvgSq, "exp_avg_sq." + key, data[2]);
}

void name_shard_files(CheckpointImage& img, int rank, int ranks) {
  img.sharded = true;
  img.rank = rank, img.ranks = ranks;
  if (ranks > 1) {
    img.model_file = fmt::format("model-rank{:05d}.safetensors", rank);
    img.optimizer_file = fmt::format("optimizer-rank{:05d}.safetensors", rank);
  }
}

CheckpointImage CheckpointManager::capture_shard(Trainer& t, int64_t step, Tensor* copy_into, Allocator* alloc) const {
  CheckpointImage img;
  img.step = step;
  name_shard_files(img, rank_, ranks_);
  const auto& cfg = t.config();
  const auto& par = t.parallelism();
  const spec::ParamTable& table = t.params().table();
  const AdamW& adam = t.optimizer();
  const auto pieces = save_pieces(table, saved_ranges(table, cfg.model.resolved.n_layers, par.dp_size(), par.dp_rank(),
                                                      t.zero_stage() > 0 ? adam.pieces() : std::vector<spec::ArenaRange>{},
                                                      par.ep_size()));
  // Where arena element `a` of a moment sits: in the optimizer piece holding it (the whole arena
  // without ZeRO).
  auto moment_offset = [&](int64_t a) -> int64_t {
    for (size_t k = 0; k < adam.pieces().size(); ++k)
      if (a >= adam.pieces()[k].begin && a < adam.pieces()[k].end) return adam.local_offset(k) + (a - adam.pieces()[k].begin);
    throw Error("internal: arena element " + std::to_string(a) + " is in none of this rank's optimizer pieces");
  };
  // bf16-pure keeps weights and moments in bf16: they are saved widened to f32 (exact, so a resume is
  // bitwise), which needs a copy even for a synchronous save.
  const bool widen = t.params().bf16_only();
  Tensor widened;
  if (widen && !copy_into) copy_into = &widened;
  float* copy = nullptr;
  if (copy_into) {
    int64_t n = 0;
    for (const auto& p : pieces) n += p.end - p.begin;
    if (!copy_into->defined() || copy_into->numel() < 3 * n) {
      if (!alloc) throw Error("internal: a checkpoint copy needs an allocator");
      *copy_into = Tensor::empty({std::max<int64_t>(3 * n, 1)}, DType::F32, *alloc, MemCategory::Workspace);
    }
    img.owned = *copy_into;
    copy = img.owned.data<float>();
  }
  std::unordered_map<std::string, int> seen;  // pieces of each parameter in this rank's files so far
  for (const auto& piece : pieces) {
    const auto& p = table.params()[piece.param];
    const int64_t n = piece.end - piece.begin;
    const size_t bytes = static_cast<size_t>(n) * sizeof(float);
    const float* src[3] = {nullptr, nullptr, nullptr};
    if (widen) {
      t.params().read_f32(piece.begin, n, copy);
      kernels::cast_bf16_to_f32(copy + n, adam.m().data<bf16>() + moment_offset(piece.begin), n);
      kernels::cast_bf16_to_f32(copy + 2 * n, adam.v().data<bf16>() + moment_offset(piece.begin), n);
      for (int k = 0; k < 3; ++k) src[k] = copy + k * n;
      copy += 3 * n;
    } else {
      src[0] = t.params().master().data<float>() + piece.begin;
      src[1] = adam.m().data<float>() + moment_offset(piece.begin);
      src[2] = adam.v().data<float>() + moment_offset(piece.begin);
      if (copy)
        for (auto*& s : src) {
          std::memcpy(copy, s, bytes);
          s = copy, copy += n;
        }
    }
    add_piece(img, p, piece, src, seen);
  }
  const auto& data = t.data();
  img.tokenizer_file = data.tokenizer_file();
  img.tokenizer_hash = data.tokenizer_hash();
  if (rank_ == 0) {
    img.facts = checkpoint_facts(t, step);
    add_fp8_state(img.facts, t);
  }
  return img;
}

std::string CheckpointManager::save(Trainer& trainer, int64_t step) { return write(capture(trainer, step)); }

std::string CheckpointManager::write(const CheckpointImage& img) {
  if (!img.sharded) return write_whole(img);
  const fs::path dir(dir_);
  const std::string name = step_name(img.step);
  // One folder for every rank's files: named by the run, which every rank shares.
  const fs::path tmp = dir / (".tmp-" + name + "-" + run_id_);
  const fs::path final_path = dir / name;
  auto previous = latest();
  const auto failed = [&](const std::string& why) {
    return IoError(std::string("saving the checkpoint of step ") + std::to_string(img.step) + " failed: " + why +
                   (previous ? "; the previous checkpoint '" + *previous + "' is intact" : "; no earlier checkpoint exists"));
  };
  try {
    write_part(img, tmp.string());
  } catch (const Error& e) {
    // Rank 0 is waiting for this part: tell it why it will not come, so its save fails now and names us.
    std::error_code ec;
    if (fs::is_directory(tmp, ec)) {
      try {
        write_file_atomically((tmp / failed_name(img.rank)).string(), e.what());
      } catch (const Error&) {
      }
    }
    throw failed(e.what());
  }
  if (img.rank != 0) return final_path.string();
  try {
    json manifest = manifest_head(img);
    manifest["tokenizer"] = img.tokenizer_file.empty() ? json(nullptr)
                                                       : json{{"file", "tokenizer.model"}, {"hash", img.tokenizer_hash}};
    manifest["tensors"] = merge_parts(tmp.string(), img.ranks, img.facts.at("params"));
    if (!img.tokenizer_file.empty()) {
      std::error_code ec;
      fs::copy_file(img.tokenizer_file, tmp / "tokenizer.model", fs::copy_options::overwrite_existing, ec);
      if (ec) throw IoError("cannot copy the tokenizer '" + img.tokenizer_file + "': " + ec.message());
    }
    fault_point("manifest");
    std::error_code ec;
    for (int r = 0; r < img.ranks; ++r) fs::remove(tmp / part_name(r), ec);  // the manifest holds them now
    publish(tmp.string(), manifest.dump(1), img.step);
  } catch (const Error& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw failed(e.what());
  }
  prune(final_path.string());
  return final_path.string();
}

json CheckpointManager::manifest_head(const CheckpointImage& img) const {
  json manifest{{"format", kCheckpointFormat},
                {"version", kCheckpointVersion},
                {"step", img.step},
                {"run_id", run_id_},
                {"created_unix", std::chrono::duration_cast<std::chrono::seconds>(
                                     std::chrono::system_clock::now().time_since_epoch()).count()}};
  for (const auto& [k, v] : img.facts.items()) manifest[k] = v;
  return manifest;
}

json CheckpointManager::checksummed_index(const CheckpointImage& img) {
  // The index lists weight, exp_avg, exp_avg_sq per tensor (or piece): the model file's entries and,
  // two by two, the optimizer file's.
  json index = img.index;
  for (size_t i = 0; i < index.size(); ++i) {
    const SafetensorsEntry& e = i % 3 == 0 ? img.model[i / 3] : img.optimizer[2 * (i / 3) + (i % 3) - 1];
    index[i]["checksum"] = checksum_hex(checksum64(e.data, e.nbytes));
  }
  return index;
}

void CheckpointManager::publish(const std::string& tmp_dir, const std::string& manifest, int64_t step) const {
  const fs::path dir(dir_), tmp(tmp_dir), final_path = dir / step_name(step);
  {
    FileWriter w((tmp / "manifest.json").string());
    w.write(manifest.data(), manifest.size());
    w.sync();
    w.close();
  }
  fsync_directory(tmp.string());
  fault_point("fsync");
  std::error_code ec;
  fs::remove_all(final_path, ec);  // a stale folder of the same step (never `latest`)
  fault_point("rename");
  fs::rename(tmp, final_path, ec);
  if (ec) throw IoError("cannot rename '" + tmp.string() + "' to '" + final_path.string() + "': " + ec.message());
  fsync_directory(dir.string());
  fault_point("latest");
  write_file_atomically((dir / "latest").string(), step_name(step) + "\n");
}

void CheckpointManager::write_part(const CheckpointImage& img, const std::string& tmp_dir) const {
  const fs::path tmp(tmp_dir);
  std::error_code ec;
  fs::create_directories(tmp, ec);
  if (ec) throw IoError("cannot create '" + tmp.string() + "': " + ec.message());
  SafetensorsWriteOptions opts;
  opts.sync = true;
  if (uint64_t limit = fault_byte_limit(img.rank))
    opts.on_progress = [limit](uint64_t n) {
      if (n >= limit) std::_Exit(86);
    };
  write_safetensors((tmp / img.model_file).string(), img.model, {{"format", "pt"}}, opts);
  fault_point("tensor_data");
  write_safetensors((tmp / img.optimizer_file).string(), img.optimizer, {}, opts);
  const json index = checksummed_index(img);
  fault_point("part");
  // Written whole or not at all: its presence tells rank 0 this rank's files are on disk.
  write_file_atomically((tmp / part_name(img.rank)).string(), json{{"rank", img.rank}, {"tensors", index}}.dump());
}

json CheckpointManager::merge_parts(const std::string& tmp_dir, int ranks, const json& params) const {
  const fs::path tmp(tmp_dir);
  const auto deadline = std::chrono::steady_clock::now() + comm::kSaveTimeout;
  json tensors = json::array();
  for (int r = 0; r < ranks; ++r) {
    const fs::path part = tmp / part_name(r);
    for (;;) {
      std::error_code ec;
      if (fs::exists(part, ec)) break;
      if (fs::exists(tmp / failed_name(r), ec))
        throw IoError("rank " + std::to_string(r) + " could not write its part: " + read_file((tmp / failed_name(r)).string()));
      if (std::chrono::steady_clock::now() > deadline)
        throw IoError(fmt::format("rank {} did not write its part within {} s (it died, or its disk is that slow)", r,
                                  std::chrono::duration_cast<std::chrono::seconds>(comm::kSaveTimeout).count()));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    json j;
    try {
      j = json::parse(read_file(part.string()));
    } catch (const json::exception& e) {
      throw IoError("rank " + std::to_string(r) + "'s part index '" + part.string() + "' is not valid JSON: " + e.what());
    }
    for (auto& e : j.at("tensors")) tensors.push_back(std::move(e));
  }
  // Every element of every tensor written once: a layout whose pieces left a hole would be a checkpoint
  // that cannot be loaded, found here rather than at the next resume.
  json draft{{"format", kCheckpointFormat}, {"version", kCheckpointVersion}, {"step", 0}, {"optimizer", {{"steps", 0}}},
             {"config_toml", ""}, {"params", params}, {"tensors", tensors}};
  const CheckpointManifest parsed = parse_checkpoint_manifest(draft.dump(), tmp_dir + "/part-rank*.json");
  if (const auto holes = CheckpointReader(tmp, parsed).holes(); !holes.empty())
    throw IoError("internal: the ranks' pieces leave a hole: " + holes.front());
  return tensors;
}

std::string CheckpointManager::write_whole(const CheckpointImage& img) {
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
    if (uint64_t limit = fault_byte_limit(rank_))
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
    const json index = checksummed_index(img);
    json manifest = manifest_head(img);
    manifest["tokenizer"] = tokenizer;
    manifest["tensors"] = index;
    fault_point("manifest");
    publish(tmp.string(), manifest.dump(1), img.step);
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

// Fills the parameter (and, when given, optimizer) arenas from a checkpoint of any layout: each tensor's
// elements this rank holds, wherever the pieces that hold them are.
// weights_kept: the arena ranges whose weights this rank holds (a ZeRO-3 shard); empty means all.
void load_tensors(const fs::path& dir, const CheckpointManifest& m, model::ParameterStore& params, AdamW* adam,
                  std::span<const spec::ArenaRange> weights_kept = {}) {
  CheckpointReader reader(dir, m);
  const spec::ParamTable& table = params.table();
  std::map<std::string, std::vector<int64_t>> saved;
  for (const auto& p : m.params) saved[p.name] = p.shape;
  // The whole model's tensors first: a checkpoint of another shape or model is refused before anything
  // is read.
  for (const auto& p : table.params()) {
    if (auto it = saved.find(p.name); it != saved.end() && it->second != p.global_shape)
      throw IoError("checkpoint tensor '" + p.name + "' has shape " + json(it->second).dump() + ", the model expects " +
                    json(p.global_shape).dump());
    for (TensorRole role : {TensorRole::Weight, TensorRole::ExpAvg, TensorRole::ExpAvgSq})
      if ((role == TensorRole::Weight || adam) && !reader.holds(p.name, role))
        throw IoError("checkpoint '" + dir.string() + "' holds no " + role_name(role) + " of tensor '" + p.name +
                      "' that this model needs; it is not a checkpoint of this model");
  }
  // f32 state is read in place; bf16-pure's bf16 state through one tensor's worth of f32, rounded to
  // nearest (exact for what bf16-pure saved; a checkpoint of f32 masters is rounded once).
  const bool narrow = params.bf16_only();
  std::vector<float> staged;
  auto read_into = [&](const spec::ParamSpec& p, TensorRole role, int64_t begin, int64_t end, const Tensor& arena,
                       int64_t at) {
    if (!narrow) return reader.read(table, p, role, begin, end, arena.data<float>() + at);
    staged.resize(static_cast<size_t>(end - begin));
    reader.read(table, p, role, begin, end, staged.data());
    kernels::cast_f32_to_bf16(arena.data<bf16>() + at, staged.data(), end - begin);
  };
  const Tensor& weights = params.weights();
  for (const auto& p : table.params()) {
    const spec::ArenaRange whole{p.offset, p.offset + p.numel()};
    const auto kept = weights_kept.empty() ? std::vector<spec::ArenaRange>{whole}
                                           : spec::intersect({weights_kept.begin(), weights_kept.end()}, {whole});
    for (const auto& r : kept) read_into(p, TensorRole::Weight, r.begin - p.offset, r.end - p.offset, weights, r.begin);
    if (!adam) continue;
    // Moments: only the parts inside this rank's optimizer pieces (all of it without ZeRO).
    for (size_t k = 0; k < adam->pieces().size(); ++k) {
      const auto& piece = adam->pieces()[k];
      const int64_t a = std::max(piece.begin, whole.begin), b = std::min(piece.end, whole.end);
      if (a >= b) continue;
      const int64_t local = adam->local_offset(k) + (a - piece.begin);
      read_into(p, TensorRole::ExpAvg, a - p.offset, b - p.offset, adam->m(), local);
      read_into(p, TensorRole::ExpAvgSq, a - p.offset, b - p.offset, adam->v(), local);
    }
  }
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
  if (m.version < kOldestCheckpointVersion || m.version > kCheckpointVersion)
    throw IoError("'" + dir.string() + "' is a Loom checkpoint of version " + std::to_string(m.version) +
                  "; this build reads versions " + std::to_string(kOldestCheckpointVersion) + " to " +
                  std::to_string(kCheckpointVersion));
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
      // gathered; context-parallel ranks are replicas of the weights; each expert by the first ep group),
      // so dp, tp, pp, cp, ep, zero, the pipeline's schedule and cut and the bucket size may change on
      // resume; a different model may not.
      const bool free_layout_key = key == "parallel.dp" || key == "parallel.tp" || key == "parallel.pp" ||
                                   key == "parallel.cp" || key == "parallel.cp_mode" || key == "parallel.ep" ||
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
  if (trainer.fp8()) trainer.fp8()->restore(m.fp8_amax_history);
  trainer.weights_changed();
  report.step = m.step;
  trainer.set_start_step(report.step);
  return report;
}

}  // namespace loom::train
