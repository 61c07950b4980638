#include "loom/train/shard_set.h"

#include <climits>
#include <fstream>
#include <sstream>
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

// An integer field in [lo, hi]. nlohmann's get<int64_t>() would convert a float (1e300) without a range
// check, which is undefined behaviour; a count read from a file is an integer or the file is damaged.
int64_t integer(const json& v, const std::string& what, int64_t lo, int64_t hi) {
  const bool ok = v.is_number_integer() &&
                  (v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                                          : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi);
  if (!ok)
    throw IoError(what + " is " + v.dump() + ", not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                  "]: re-run `loom prepare` to rewrite it");
  return v.get<int64_t>();
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
  std::stringstream text;
  text << in.rdbuf();
  return parse_shard_set(text.str(), path);
}

ShardSet parse_shard_set(const std::string& text, const fs::path& path) {
  const std::string fix = "re-run `loom prepare` to rewrite it";
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw IoError("'" + path.string() + "' is not valid JSON (" + e.what() + "): " + fix);
  }
  ShardSet s;
  const std::string where = path.string() + ": ";
  try {
    if (j.at("format") != kShardSetFormat)
      throw IoError("'" + path.string() + "' is not a Loom shard-set manifest (format is not \"" + kShardSetFormat +
                    "\")");
    if (!j.at("version").is_number_integer() || j.at("version") != kShardSetVersion)
      throw IoError("'" + path.string() + "' has version " + j.at("version").dump() + "; this build reads version " +
                    std::to_string(kShardSetVersion) + ": " + fix);
    const json& t = j.at("tokenizer");
    s.tokenizer_file = t.at("file").get<std::string>();
    s.tokenizer_hash = parse_hex(t.at("hash").get<std::string>(), path.string() + ": tokenizer.hash");
    s.vocab_size = integer(t.at("vocab_size"), where + "tokenizer.vocab_size", 1, INT32_MAX);
    s.eos_id = static_cast<int32_t>(integer(t.at("eos_id"), where + "tokenizer.eos_id", -1, INT32_MAX));
    s.tokenizer_trained = t.at("trained").get<bool>();
    s.inputs = j.at("inputs").get<std::vector<std::string>>();
    s.files = integer(j.at("files"), where + "files", 0, INT64_MAX);
    const json& sp = j.at("split");
    const json& seed = sp.at("seed");
    if (!seed.is_number_unsigned()) throw IoError(where + "split.seed is " + seed.dump() + ", not an unsigned integer");
    s.seed = seed.get<uint64_t>();
    s.val_fraction = sp.at("val_fraction").get<double>();
    if (!(s.val_fraction >= 0 && s.val_fraction < 1))
      throw IoError(where + "split.val_fraction is " + sp.at("val_fraction").dump() + ", not in [0, 1)");
    for (const json& id : sp.at("validation_document_ids"))
      s.validation_document_ids.push_back(integer(id, where + "split.validation_document_ids[]", 0, INT64_MAX));
    s.train_documents = integer(j.at("documents").at("train"), where + "documents.train", 0, INT64_MAX);
    s.validation_documents = integer(j.at("documents").at("validation"), where + "documents.validation", 0, INT64_MAX);
    s.train_tokens = integer(j.at("tokens").at("train"), where + "tokens.train", 0, INT64_MAX);
    s.validation_tokens = integer(j.at("tokens").at("validation"), where + "tokens.validation", 0, INT64_MAX);
    for (const json& e : j.at("shards")) {
      ShardEntry x;
      x.file = e.at("file").get<std::string>();
      const std::string split = e.at("split").get<std::string>();
      if (split != "train" && split != "validation")
        throw IoError("'" + path.string() + "': shard '" + x.file + "' has split '" + split +
                      "' (valid: train, validation)");
      x.split = split == "train" ? Split::Train : Split::Validation;
      x.tokens = integer(e.at("tokens"), where + "tokens of shard " + x.file, 0, INT64_MAX);
      x.documents = integer(e.at("documents"), where + "documents of shard " + x.file, 0, INT64_MAX);
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
  if (s.eos_id >= s.vocab_size)
    throw IoError("'" + path.string() + "': tokenizer.eos_id " + std::to_string(s.eos_id) + " is outside the vocabulary of " +
                  std::to_string(s.vocab_size) + ": " + fix);
  return s;
}

}  // namespace loom::train
