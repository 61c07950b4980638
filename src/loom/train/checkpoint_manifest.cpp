#include "loom/train/checkpoint_manifest.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/file_reader.h"
#include "loom/error.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Typed field access that names the file and the key; nlohmann's own get<>() converts a float to an
// integer without a range check (undefined behaviour for 1e300), so integers are checked here.
struct Fields {
  const std::string& origin;

  [[noreturn]] void fail(const std::string& problem) const {
    throw IoError("checkpoint manifest '" + origin + "': " + problem + ": the checkpoint is damaged");
  }
  const json& at(const json& j, const char* key, const std::string& where) const {
    if (!j.is_object()) fail(where + " is not a JSON object");
    auto it = j.find(key);
    if (it == j.end()) fail(where + " lacks '" + key + "'");
    return *it;
  }
  std::string string(const json& v, const std::string& what) const {
    if (!v.is_string()) fail(what + " is not a string");
    return v.get<std::string>();
  }
  int64_t count(const json& v, const std::string& what) const {
    if (v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) &&
        v.get<int64_t>() >= 0)
      return v.get<int64_t>();
    fail(what + " is " + v.dump() + ", not a non-negative integer");
  }
};

// A file the manifest names must stay inside the checkpoint folder.
bool plain_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

}  // namespace

const char* role_name(TensorRole role) {
  switch (role) {
    case TensorRole::Weight: return "weight";
    case TensorRole::ExpAvg: return "exp_avg";
    case TensorRole::ExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

CheckpointManifest parse_checkpoint_manifest(const std::string& text, const std::string& origin) {
  const Fields f{origin};
  json m;
  try {
    m = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError("'" + origin + "' is not valid JSON (" + e.what() + "): the checkpoint is damaged");
  }
  if (!m.is_object() || !m.contains("format") || m["format"] != kCheckpointFormat)
    throw IoError("'" + origin + "' is not a Loom checkpoint manifest (format is not \"" + kCheckpointFormat + "\")");
  CheckpointManifest out;
  out.version = f.count(f.at(m, "version", "the manifest"), "version");
  out.step = f.count(f.at(m, "step", "the manifest"), "step");
  if (m.contains("run_id")) out.run_id = f.string(m["run_id"], "run_id");
  out.optimizer_steps = f.count(f.at(f.at(m, "optimizer", "the manifest"), "steps", "optimizer"), "optimizer.steps");
  if (m.contains("tokenizer") && !m["tokenizer"].is_null()) {
    const json& t = m["tokenizer"];
    if (!t.is_object()) f.fail("tokenizer is neither null nor an object");
    CheckpointTokenizer tok{"tokenizer.model", ""};
    if (t.contains("file")) tok.file = f.string(t["file"], "tokenizer.file");
    if (!plain_name(tok.file)) f.fail("tokenizer.file '" + tok.file + "' is not a file in the checkpoint folder");
    tok.hash = f.string(f.at(t, "hash", "tokenizer"), "tokenizer.hash");
    out.tokenizer = std::move(tok);
  }
  out.config_toml = f.string(f.at(m, "config_toml", "the manifest"), "config_toml");
  if (m.contains("fp8")) {
    const json& history = f.at(m["fp8"], "amax_history", "fp8");
    if (!history.is_object()) f.fail("fp8.amax_history is not an object");
    for (const auto& [name, values] : history.items()) {
      if (!values.is_array()) f.fail("fp8.amax_history." + name + " is not an array");
      std::vector<float> h;
      for (const json& v : values) {
        if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0 ||
            v.get<double>() > std::numeric_limits<float>::max())
          f.fail("fp8.amax_history." + name + " holds " + v.dump() + ", not a finite amax");
        h.push_back(v.get<float>());
      }
      out.fp8_amax_history.emplace_back(name, std::move(h));
    }
  }
  const json& tensors = f.at(m, "tensors", "the manifest");
  if (!tensors.is_array()) f.fail("tensors is not an array");
  auto shape_of = [&](const json& v, const std::string& what) {
    if (!v.is_array()) f.fail(what + " is not an array");
    std::vector<int64_t> shape;
    for (size_t d = 0; d < v.size(); ++d) shape.push_back(f.count(v[d], what + "[" + std::to_string(d) + "]"));
    return shape;
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const json& e = tensors[i];
    const std::string where = "tensors[" + std::to_string(i) + "]";
    CheckpointTensorEntry t;
    t.name = f.string(f.at(e, "name", where), where + ".name");
    t.param = f.string(f.at(e, "param", where), where + ".param");
    t.file = f.string(f.at(e, "file", where), where + ".file");
    if (!plain_name(t.file) || !t.file.ends_with(".safetensors"))
      f.fail(where + ".file '" + t.file + "' is not a .safetensors file in the checkpoint folder");
    if (e.contains("role")) {
      const std::string role = f.string(e["role"], where + ".role");
      if (role == "weight") t.role = TensorRole::Weight;
      else if (role == "exp_avg") t.role = TensorRole::ExpAvg;
      else if (role == "exp_avg_sq") t.role = TensorRole::ExpAvgSq;
      else f.fail(where + ".role is '" + role + "' (valid: weight, exp_avg, exp_avg_sq)");
    } else {  // version 1: the file says weight or moment, the key's prefix which moment
      if (t.file != "model.safetensors" && t.file != "optimizer.safetensors")
        f.fail(where + ".file is '" + t.file + "' (valid: model.safetensors, optimizer.safetensors)");
      t.role = t.file == "model.safetensors"          ? TensorRole::Weight
               : t.name.rfind("exp_avg_sq.", 0) == 0 ? TensorRole::ExpAvgSq
                                                      : TensorRole::ExpAvg;
    }
    t.checksum = f.string(f.at(e, "checksum", where), where + ".checksum");
    if (e.contains("runs")) {
      const json& runs = e["runs"];
      if (!runs.is_array()) f.fail(where + ".runs is not an array");
      for (size_t k = 0; k < runs.size(); ++k) {
        const std::string rw = where + ".runs[" + std::to_string(k) + "]";
        if (!runs[k].is_array() || runs[k].size() != 4) f.fail(rw + " is not [global, length, stride, count]");
        PieceRun r{f.count(runs[k][0], rw), f.count(runs[k][1], rw), f.count(runs[k][2], rw), f.count(runs[k][3], rw)};
        if (r.length > (int64_t{1} << 40) || r.count > (int64_t{1} << 40) || r.stride > (int64_t{1} << 50) ||
            r.global > (int64_t{1} << 50))
          f.fail(rw + " is out of range");
        t.runs.push_back(r);
      }
      if (t.runs.empty()) f.fail(where + ".runs is empty");
    } else if (t.role == TensorRole::Weight && e.contains("shape") && !m.contains("params")) {
      out.params.push_back({t.param, shape_of(e["shape"], where + ".shape"), e.contains("placement") && e["placement"].is_string() ? e["placement"].get<std::string>() : ""});
    }
    out.tensors.push_back(std::move(t));
  }
  if (m.contains("params")) {
    const json& params = m["params"];
    if (!params.is_array()) f.fail("params is not an array");
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string where = "params[" + std::to_string(i) + "]";
      CheckpointParam p;
      p.name = f.string(f.at(params[i], "name", where), where + ".name");
      p.shape = shape_of(f.at(params[i], "shape", where), where + ".shape");
      if (params[i].contains("placement")) p.placement = f.string(params[i]["placement"], where + ".placement");
      out.params.push_back(std::move(p));
    }
  }
  if (m.contains("ranks")) out.ranks = f.count(m["ranks"], "ranks");
  return out;
}

CheckpointManifest read_checkpoint_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / "manifest.json").string();
  return parse_checkpoint_manifest(read_file(path), path);
}

}  // namespace loom::train
