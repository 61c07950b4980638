#include "loom/train/shard_set.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/core/checksum.h"
#include "loom/core/file_writer.h"
#include "loom/error.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

uint64_t parse_hex(const std::string& s, const std::string& what) {
  size_t used = 0;
  uint64_t v = 0;
  try {
    v = std::stoull(s, &used, 16);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || s.empty()) throw IoError(what + " is not a hexadecimal hash: '" + s + "'");
  return v;
}

// A shard or tokenizer name must stay inside the folder.
bool plain_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

}  // namespace

const char* split_name(Split s) { return s == Split::Train ? "train" : "validation"; }

void write_shard_set(const fs::path& dir, const ShardSet& s) {
  json shards = json::array();
  for (const auto& e : s.shards)
    shards.push_back({{"file", e.file},
                      {"split", split_name(e.split)},
                      {"tokens", e.tokens},
                      {"documents", e.documents},
                      {"checksum", checksum_hex(e.checksum)}});
  json j = {
      {"format", kShardSetFormat},
      {"version", kShardSetVersion},
      {"tokenizer",
       {{"file", s.tokenizer_file},
        {"hash", checksum_hex(s.tokenizer_hash)},
        {"vocab_size", s.vocab_size},
        {"eos_id", s.eos_id},
        {"trained", s.tokenizer_trained}}},
      {"inputs", s.inputs},
      {"files", s.files},
      {"split",
       {{"rule",
         "the round(val_fraction * documents) documents with the smallest Philox(seed, index) keys are validation"},
        {"seed", s.seed},
        {"val_fraction", s.val_fraction},
        {"validation_document_ids", s.validation_document_ids}}},
      {"documents", {{"train", s.train_documents}, {"validation", s.validation_documents}}},
      {"tokens", {{"train", s.train_tokens}, {"validation", s.validation_tokens}}},
      {"shards", shards},
  };
  write_file_atomically((dir / kShardSetManifest).string(), j.dump(2) + "\n");
}

ShardSet read_shard_set(const fs::path& dir) {
  const fs::path path = dir / kShardSetManifest;
  std::ifstream in(path);
  if (!in) {
    if (!fs::exists(dir))
      throw IoError("data folder '" + dir.string() + "' does not exist: run `loom prepare --input TEXT --out " +
                    dir.string() + "`");
    throw IoError("'" + path.string() +
                  "' is missing: the folder holds no complete shard set; run `loom prepare --out " + dir.string() +
                  "` again");
  }
  const std::string fix = "re-run `loom prepare` to rewrite it";
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw IoError("'" + path.string() + "' is not valid JSON (" + e.what() + "): " + fix);
  }
  ShardSet s;
  try {
    if (j.at("format") != kShardSetFormat)
      throw IoError("'" + path.string() + "' is not a Loom shard-set manifest (format is not \"" + kShardSetFormat +
                    "\")");
    if (j.at("version").get<int>() != kShardSetVersion)
      throw IoError("'" + path.string() + "' has version " + j.at("version").dump() + "; this build reads version " +
                    std::to_string(kShardSetVersion) + ": " + fix);
    const json& t = j.at("tokenizer");
    s.tokenizer_file = t.at("file").get<std::string>();
    s.tokenizer_hash = parse_hex(t.at("hash").get<std::string>(), path.string() + ": tokenizer.hash");
    s.vocab_size = t.at("vocab_size").get<int64_t>();
    s.eos_id = t.at("eos_id").get<int32_t>();
    s.tokenizer_trained = t.at("trained").get<bool>();
    s.inputs = j.at("inputs").get<std::vector<std::string>>();
    s.files = j.at("files").get<int64_t>();
    const json& sp = j.at("split");
    s.seed = sp.at("seed").get<uint64_t>();
    s.val_fraction = sp.at("val_fraction").get<double>();
    s.validation_document_ids = sp.at("validation_document_ids").get<std::vector<int64_t>>();
    s.train_documents = j.at("documents").at("train").get<int64_t>();
    s.validation_documents = j.at("documents").at("validation").get<int64_t>();
    s.train_tokens = j.at("tokens").at("train").get<int64_t>();
    s.validation_tokens = j.at("tokens").at("validation").get<int64_t>();
    for (const json& e : j.at("shards")) {
      ShardEntry x;
      x.file = e.at("file").get<std::string>();
      const std::string split = e.at("split").get<std::string>();
      if (split != "train" && split != "validation")
        throw IoError("'" + path.string() + "': shard '" + x.file + "' has split '" + split +
                      "' (valid: train, validation)");
      x.split = split == "train" ? Split::Train : Split::Validation;
      x.tokens = e.at("tokens").get<int64_t>();
      x.documents = e.at("documents").get<int64_t>();
      x.checksum = parse_hex(e.at("checksum").get<std::string>(), path.string() + ": checksum of " + x.file);
      if (!plain_name(x.file))
        throw IoError("'" + path.string() + "': shard name '" + x.file + "' must be a file in the folder");
      s.shards.push_back(std::move(x));
    }
  } catch (const json::exception& e) {
    throw IoError("'" + path.string() + "' is malformed (" + e.what() + "): " + fix);
  }
  if (!plain_name(s.tokenizer_file))
    throw IoError("'" + path.string() + "': tokenizer file '" + s.tokenizer_file + "' must be a file in the folder");
  if (s.vocab_size <= 0) throw IoError("'" + path.string() + "': tokenizer.vocab_size must be positive: " + fix);
  return s;
}

}  // namespace loom::train
