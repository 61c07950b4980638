#include "loom/train/checkpoint_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "loom/core/checksum.h"
#include "loom/error.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {
int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

CheckpointReader::CheckpointReader(fs::path dir, const CheckpointManifest& m) : dir_(std::move(dir)), m_(m) {
  for (const auto& p : m.params) shapes_[p.name] = p.shape;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    if (!t.runs.empty()) {
      index_.add(key(t.param, t.role), i, t.runs);
    } else {  // a whole tensor (version 1)
      auto it = shapes_.find(t.param);
      const int64_t n = it == shapes_.end() ? 0 : product(it->second);
      index_.add(key(t.param, t.role), i, {{0, n, n, 1}});
    }
  }
}

std::string CheckpointReader::key(const std::string& param, TensorRole role) { return param + "/" + role_name(role); }

bool CheckpointReader::holds(const std::string& param, TensorRole role) const { return index_.contains(key(param, role)); }

std::vector<int64_t> CheckpointReader::shape(const std::string& param) const {
  auto it = shapes_.find(param);
  return it == shapes_.end() ? std::vector<int64_t>{} : it->second;
}

void CheckpointReader::read_global(const std::string& param, TensorRole role, int64_t global, int64_t n, float* dst) {
  const std::string k = key(param, role);
  if (!index_.contains(k))
    throw IoError("checkpoint '" + dir_.string() + "' holds no " + role_name(role) + " of tensor '" + param +
                  "': it is not a checkpoint of this model");
  const int64_t reached = index_.find(k, global, n, [&](const PieceIndex::Source& src, int64_t take) {
    std::memcpy(dst, entry_data(src.entry) + src.offset, static_cast<size_t>(take) * sizeof(float));
    dst += take;
  });
  if (reached < global + n)
    throw IoError(fmt::format("checkpoint '{}': no file holds element {} of tensor '{}' ({}): manifest.json does not "
                              "cover the tensor; the checkpoint is incomplete, resume from an earlier one",
                              dir_.string(), reached, param, role_name(role)));
}

void CheckpointReader::read(const spec::ParamTable& table, const spec::ParamSpec& p, TensorRole role, int64_t begin,
                            int64_t end, float* dst) {
  table.for_each_global_run(p, begin, end, [&](int64_t local, int64_t global, int64_t n) {
    float* out = dst + (local - begin);
    if (global < 0)
      std::fill(out, out + n, 0.0f);
    else
      read_global(p.name, role, global, n, out);
  });
}

std::vector<std::string> CheckpointReader::holes() const {
  std::vector<std::string> out;
  for (const auto& p : m_.params) {
    const int64_t n = product(p.shape);
    for (auto role : {TensorRole::Weight, TensorRole::ExpAvg, TensorRole::ExpAvgSq})
      if (const int64_t gap = index_.first_gap(key(p.name, role), n); gap < n)
        out.push_back(fmt::format("{} ({}): element {} of {} is in no piece", p.name, role_name(role), gap, n));
  }
  return out;
}

std::vector<float> CheckpointReader::read_whole(const std::string& param, TensorRole role) {
  const auto s = shape(param);
  if (s.empty() && !holds(param, role))
    throw IoError("checkpoint '" + dir_.string() + "' holds no tensor '" + param + "'");
  std::vector<float> out(static_cast<size_t>(product(s)));
  read_global(param, role, 0, static_cast<int64_t>(out.size()), out.data());
  return out;
}

const float* CheckpointReader::entry_data(size_t i) {
  const CheckpointTensorEntry& t = m_.tensors[i];
  auto f = files_.find(t.file);
  if (f == files_.end()) {
    try {
      f = files_.emplace(t.file, std::make_unique<SafetensorsFile>((dir_ / t.file).string())).first;
    } catch (const Error& e) {
      throw IoError("checkpoint '" + dir_.string() + "': shard file '" + t.file + "' cannot be read (" + e.what() +
                    "); the checkpoint is incomplete or damaged, resume from an earlier one");
    }
  }
  if (!f->second->contains(t.name))
    throw IoError("checkpoint '" + dir_.string() + "': '" + t.file + "' lacks tensor '" + t.name +
                  "' that manifest.json lists; resume from an earlier checkpoint");
  const auto& e = f->second->at(t.name);
  if (verified_.insert(i).second) {
    auto s = shapes_.find(t.param);
    const int64_t want = !t.runs.empty() ? runs_numel(t.runs) : s != shapes_.end() ? product(s->second) : -1;
    const bool shape_ok = !t.runs.empty() || s == shapes_.end() || e.shape == s->second;
    if (e.dtype != DType::F32 || (want >= 0 && static_cast<int64_t>(e.nbytes / sizeof(float)) != want) || !shape_ok) {
      verified_.erase(i);
      throw IoError("checkpoint tensor '" + t.name + "' in '" + t.file + "' is " + std::string(dtype_name(e.dtype)) +
                    " of shape " + json(e.shape).dump() + "; the manifest says F32 with " + std::to_string(want) +
                    " elements" + (s != shapes_.end() ? " of the tensor " + json(s->second).dump() : ""));
    }
    if (checksum_hex(checksum64(e.data, e.nbytes)) != t.checksum) {
      verified_.erase(i);
      throw IoError("checkpoint '" + dir_.string() + "': tensor '" + t.name + "' in '" + t.file +
                    "' is corrupted (checksum mismatch); resume from an earlier checkpoint");
    }
  }
  return static_cast<const float*>(e.data);
}

}  // namespace loom::train
