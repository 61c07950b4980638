// A shard set's manifest.json: what write_shard_set writes reads back, and numbers that are not what
// the field holds are refused naming the file and the field (fuzz/shard_set_fuzz.cpp found the float
// case: nlohmann's get<int64_t>() on -9.2e21 is undefined behaviour).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data_test_util.h"
#include "loom/error.h"
#include "loom/train/shard_set.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class ShardSetManifest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::log_seed();
    const uint64_t seed = test::fresh_seed();
    set_.tokenizer_hash = seed;
    set_.vocab_size = 300 + static_cast<int64_t>(seed % 1000);
    set_.eos_id = 3;
    set_.seed = seed * 7;
    set_.val_fraction = 0.25;
    set_.inputs = {"a.txt"};
    set_.files = 1;
    set_.train_documents = 3, set_.validation_documents = 1;
    set_.train_tokens = 100, set_.validation_tokens = 20;
    set_.validation_document_ids = {static_cast<int64_t>(seed % 4)};
    set_.shards = {{"train-00000.bin", Split::Train, 100, 3, seed ^ 1},
                   {"validation-00000.bin", Split::Validation, 20, 1, 2}};
    const fs::path dir = test::scratch_dir("shard-set-manifest");
    write_shard_set(dir, set_);
    std::ifstream in(dir / kShardSetManifest);
    std::stringstream s;
    s << in.rdbuf();
    written_ = json::parse(s.str());
    fs::remove_all(dir);
  }
  void expect_refused(const json& j, const std::string& why) {
    try {
      parse_shard_set(j.dump(), "data/manifest.json");
      FAIL() << "accepted: " << j.dump();
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("data/manifest.json"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
  ShardSet set_;
  json written_;
};

TEST_F(ShardSetManifest, ReadsBackWhatTheWriterWrote) {
  ShardSet s = parse_shard_set(written_.dump(), "data/manifest.json");
  EXPECT_EQ(s.tokenizer_hash, set_.tokenizer_hash);
  EXPECT_EQ(s.vocab_size, set_.vocab_size);
  EXPECT_EQ(s.seed, set_.seed);
  EXPECT_EQ(s.validation_document_ids, set_.validation_document_ids);
  ASSERT_EQ(s.shards.size(), 2u);
  EXPECT_EQ(s.shards[0].checksum, set_.shards[0].checksum);
  EXPECT_EQ(s.shards[1].split, Split::Validation);
}

TEST_F(ShardSetManifest, CountsThatAreNotIntegersInRangeAreRefused) {
  for (json bad : {json(-9.2e21), json(1e300), json(-1), json(0.5)}) {
    json j = written_;
    j["split"]["validation_document_ids"] = {0, bad};
    expect_refused(j, "split.validation_document_ids");
    j = written_;
    j["shards"][0]["tokens"] = bad;
    expect_refused(j, "tokens of shard train-00000.bin");
    j = written_;
    j["tokenizer"]["vocab_size"] = bad;
    expect_refused(j, "tokenizer.vocab_size");
    j = written_;
    j["split"]["seed"] = bad;
    expect_refused(j, "split.seed");
  }
  json j = written_;
  j["tokenizer"]["eos_id"] = 4294967296;
  expect_refused(j, "tokenizer.eos_id");
  j = written_;
  j["tokenizer"]["eos_id"] = set_.vocab_size;
  expect_refused(j, "outside the vocabulary");
  j = written_;
  j["split"]["val_fraction"] = 1;
  expect_refused(j, "split.val_fraction");
  j = written_;
  j["version"] = 1.0;
  expect_refused(j, "has version");
}

}  // namespace
}  // namespace loom::train
