// A checkpoint's manifest.json as resume, generate and export read it: what the writer writes is read
// back field by field, and a damaged or hostile file is refused with an IoError naming the file and the
// field (fuzz/checkpoint_manifest_fuzz.cpp searches for the rest).
#include "loom/train/checkpoint_manifest.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "data_test_util.h"
#include "loom/error.h"

namespace loom::train {
namespace {

using nlohmann::json;

json manifest(int64_t step) {
  return {{"format", "loom-checkpoint"},
          {"version", 1},
          {"step", step},
          {"run_id", "r-" + std::to_string(step)},
          {"optimizer", {{"type", "adamw"}, {"steps", step + 1}}},
          {"tokenizer", {{"file", "tokenizer.model"}, {"hash", "00ff"}}},
          {"config_toml", "[model]\npreset = \"tiny\"\n"},
          {"tensors",
           {{{"name", "w"}, {"param", "w"}, {"file", "model.safetensors"}, {"checksum", "0a"}, {"shape", {2, 3}}},
            {{"name", "exp_avg.w"}, {"param", "w"}, {"file", "optimizer.safetensors"}, {"checksum", "0b"}}}}};
}

void expect_refused(const json& m, const std::string& why) {
  try {
    parse_checkpoint_manifest(m.dump(), "ck/step-7/manifest.json");
    FAIL() << "accepted: " << m.dump();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("ck/step-7/manifest.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

TEST(CheckpointManifest, ReadsEveryFieldTheWriterWrites) {
  test::log_seed();
  const int64_t step = static_cast<int64_t>(test::fresh_seed() % 1000000);
  auto m = parse_checkpoint_manifest(manifest(step).dump(1), "m.json");
  EXPECT_EQ(m.version, 1);
  EXPECT_EQ(m.step, step);
  EXPECT_EQ(m.optimizer_steps, step + 1);
  EXPECT_EQ(m.run_id, "r-" + std::to_string(step));
  ASSERT_TRUE(m.tokenizer);
  EXPECT_EQ(m.tokenizer->file, "tokenizer.model");
  EXPECT_EQ(m.tokenizer->hash, "00ff");
  EXPECT_EQ(m.config_toml, "[model]\npreset = \"tiny\"\n");
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_TRUE(m.tensors[0].model());
  EXPECT_FALSE(m.tensors[1].model());
  EXPECT_EQ(m.tensors[1].name, "exp_avg.w");
  EXPECT_EQ(m.tensors[1].checksum, "0b");

  json synthetic = manifest(step);
  synthetic["tokenizer"] = nullptr;  // trained on synthetic data
  EXPECT_FALSE(parse_checkpoint_manifest(synthetic.dump(), "m.json").tokenizer);
}

// nlohmann's get<int64_t>() on 1e300 is undefined behaviour; the old reader called it on "step".
TEST(CheckpointManifest, NumbersThatAreNotCountsAreRefused) {
  for (json bad : {json(1e300), json(-1), json(2.5), json("3"), json(18446744073709551615ull)}) {
    json m = manifest(1);
    m["step"] = bad;
    expect_refused(m, "step");
    m = manifest(1);
    m["optimizer"]["steps"] = bad;
    expect_refused(m, "optimizer.steps");
  }
}

TEST(CheckpointManifest, DamagedOrForeignFilesAreRefusedNamingTheField) {
  expect_refused(json::array(), "not a Loom checkpoint manifest");
  json m = manifest(1);
  m["format"] = "loom-shards";
  expect_refused(m, "not a Loom checkpoint manifest");
  m = manifest(1);
  m.erase("config_toml");
  expect_refused(m, "lacks 'config_toml'");
  m = manifest(1);
  m["tensors"] = json::object();
  expect_refused(m, "tensors is not an array");
  m = manifest(1);
  m["tensors"][1]["file"] = "weights.bin";
  expect_refused(m, "tensors[1].file");
  m = manifest(1);
  m["tensors"][0].erase("checksum");
  expect_refused(m, "tensors[0] lacks 'checksum'");
  m = manifest(1);
  m["tokenizer"] = "tokenizer.model";
  expect_refused(m, "tokenizer is neither null nor an object");
  try {
    parse_checkpoint_manifest("{\"format\": ", "ck/step-7/manifest.json");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
  }
}

// The tokenizer file is joined to the checkpoint folder: it must not lead out of it.
TEST(CheckpointManifest, TokenizerOutsideTheFolderIsRefused) {
  for (const char* file : {"../../etc/passwd", "/etc/passwd", "..", ""}) {
    json m = manifest(1);
    m["tokenizer"]["file"] = file;
    expect_refused(m, "tokenizer.file");
  }
}

}  // namespace
}  // namespace loom::train
