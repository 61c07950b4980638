// `loom prepare` end to end: which files a corpus folder yields, how text
// becomes documents, a split by document (no document on both sides), and the
// CLI's shards feeding `loom train`.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "data_test_util.h"
#include "loom/error.h"
#include "loom/train/corpus.h"
#include "loom/train/prepare.h"
#include "loom/train/shard_format.h"
#include "loom/train/tokenizer.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;

struct Result {
  int rc;
  std::string out, err;
};

Result run_loom(const std::string& args) {
  fs::path err = fs::temp_directory_path() / ("loom-prepare-err-" + std::to_string(::getpid()));
  std::string cmd = std::string(LOOM_BINARY) + " " + args + " 2>" + err.string();
  Result r{0, "", ""};
  FILE* p = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  r.rc = WEXITSTATUS(::pclose(p));
  std::ifstream e(err);
  r.err.assign(std::istreambuf_iterator<char>(e), {});
  fs::remove(err);
  return r;
}

// A corpus folder shaped like /usr/share/games/fortunes: fortune files, their
// binary `.dat` indexes and `.u8` links, plus a plain-text file of paragraphs
// in a subfolder and a hidden file.
struct Corpus {
  fs::path dir;
  std::vector<std::string> docs;  // every document, in corpus order
};

Corpus make_corpus(const fs::path& dir, int docs_per_file) {
  test::TextGen g(test::fresh_seed());
  Corpus c{dir, {}};
  fs::create_directories(dir / "more");
  int id = 0;
  for (const char* name : {"art", "cookie"}) {
    auto d = g.fortune_file(dir / name, id, docs_per_file);
    id += docs_per_file;
    c.docs.insert(c.docs.end(), d.begin(), d.end());
    test::write_text(dir / (std::string(name) + ".dat"), std::string("\0\0\0\2\0\0\0\x10", 8) + "binary index");
    fs::create_symlink(name, dir / (std::string(name) + ".u8"));
  }
  std::string plain;
  for (int i = 0; i < docs_per_file; ++i) {
    c.docs.push_back(g.document(id++));
    plain += c.docs.back() + "\n\n\n";
  }
  test::write_text(dir / "more" / "plain.txt", plain);
  test::write_text(dir / ".hidden", "should never be read\n");
  return c;
}

// Splits a shard's tokens at end-of-document tokens and decodes each document.
std::vector<std::string> documents_in(const fs::path& shard, const Tokenizer& tok) {
  MappedShard s = MappedShard::open(shard);
  std::vector<int32_t> all(static_cast<size_t>(s.size()));
  s.copy(0, all);
  std::vector<std::string> docs;
  std::vector<int32_t> cur;
  for (int32_t t : all) {
    if (t == tok.eos_id()) {
      docs.push_back(tok.decode(cur));
      cur.clear();
    } else {
      cur.push_back(t);
    }
  }
  EXPECT_TRUE(cur.empty()) << "a shard ends with an end-of-document token";
  return docs;
}

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::log_seed();
    root_ = test::scratch_dir("prepare");
  }
  void TearDown() override { fs::remove_all(root_); }
  // A corpus under root_ (make_corpus, docs_per_file a file), prepared into root_/out with a 400-piece
  // tokenizer.
  PrepareOptions options(int docs_per_file) {
    PrepareOptions o;
    o.inputs = {make_corpus(root_ / "corpus", docs_per_file).dir.string()};
    o.out_dir = root_ / "out";
    o.vocab_size = 400;
    o.threads = 1;
    return o;
  }
  fs::path root_;
};

TEST_F(PrepareTest, FolderYieldsTextFilesOnlyOnceWithoutIndexesLinksOrHiddenFiles) {
  auto c = make_corpus(root_ / "corpus", 3);
  auto files = find_corpus_files({c.dir.string()});
  std::vector<std::string> names;
  for (auto& f : files.files) names.push_back(fs::relative(f.path, c.dir).string());
  EXPECT_EQ(names, (std::vector<std::string>{"art", "cookie", "more/plain.txt"}));
  int binary = 0, duplicate = 0;
  for (auto& s : files.skipped) binary += s.reason == "binary", duplicate += s.reason.rfind("duplicate", 0) == 0;
  EXPECT_EQ(binary, 2);
  EXPECT_EQ(duplicate, 2);
  EXPECT_THROW(find_corpus_files({(c.dir / "art.dat").string()}), IoError);
  EXPECT_THROW(find_corpus_files({(root_ / "missing").string()}), IoError);
}

TEST_F(PrepareTest, FortunesAreCutAtPercentLinesAndOtherTextAtBlankLines) {
  EXPECT_EQ(split_documents("one\nline two\n%\n\n  indented\n%\n%\nlast"),
            (std::vector<std::string>{"one\nline two", "  indented", "last"}));
  EXPECT_EQ(split_documents("a\r\n%\r\nb\r\n"), (std::vector<std::string>{"a", "b"}));
  // '%' inside a line or a '%%' line does not cut.
  EXPECT_EQ(split_documents("50% off\n%%\nstill one\n%\nb"), (std::vector<std::string>{"50% off\n%%\nstill one", "b"}));
  EXPECT_EQ(split_documents("para one\nsame para\n\n \n\npara two\n"),
            (std::vector<std::string>{"para one\nsame para", "para two"}));
  EXPECT_TRUE(split_documents("\n\n  \n").empty());
}

TEST_F(PrepareTest, SplitIsByDocumentWithNoDocumentOnBothSides) {
  auto c = make_corpus(root_ / "corpus", 60);
  PrepareOptions o;
  o.inputs = {c.dir.string()};
  o.out_dir = root_ / "out";
  o.vocab_size = 400;
  o.val_fraction = 0.2;
  o.seed = test::fresh_seed();
  o.shard_tokens = 500;  // several shards per split
  o.threads = 1;
  int progress_calls = 0;
  auto r = prepare_corpus(o, [&](const PrepareProgress&) { ++progress_calls; });
  EXPECT_GT(progress_calls, 3);

  const auto n = static_cast<int64_t>(c.docs.size());
  EXPECT_EQ(r.set.train_documents + r.set.validation_documents, n);
  EXPECT_EQ(r.set.validation_documents, std::llround(0.2 * static_cast<double>(n)));
  ShardSet set = read_shard_set(o.out_dir);
  Tokenizer tok = Tokenizer::load(o.out_dir / set.tokenizer_file);
  EXPECT_EQ(tok.hash(), set.tokenizer_hash);
  std::multiset<std::string> train, val;
  int train_shards = 0;
  for (auto& e : set.shards) {
    for (auto& d : documents_in(o.out_dir / e.file, tok)) (e.split == Split::Train ? train : val).insert(d);
    train_shards += e.split == Split::Train;
  }
  EXPECT_GT(train_shards, 1);
  EXPECT_EQ(static_cast<int64_t>(val.size()), set.validation_documents);
  for (auto& d : val) EXPECT_EQ(train.count(d), 0u) << "in both splits: " << d;
  // Every document comes back exactly once, on the side the manifest records.
  std::set<int64_t> val_ids(set.validation_document_ids.begin(), set.validation_document_ids.end());
  for (int64_t i = 0; i < n; ++i) {
    const auto& side = val_ids.count(i) ? val : train;
    EXPECT_EQ(side.count(c.docs[static_cast<size_t>(i)]), 1u) << "document " << i;
  }

  // A second run with another seed splits differently; with the same seed,
  // identically.
  o.out_dir = root_ / "out2";
  o.seed += 1;
  auto r2 = prepare_corpus(o);
  EXPECT_NE(r2.set.validation_document_ids, set.validation_document_ids);
}

TEST_F(PrepareTest, ReusedTokenizerKeepsItsHash) {
  auto c = make_corpus(root_ / "corpus", 40);
  PrepareOptions o;
  o.inputs = {c.dir.string()};
  o.out_dir = root_ / "a";
  o.vocab_size = 400;
  o.threads = 1;
  auto a = prepare_corpus(o);
  o.out_dir = root_ / "b";
  o.tokenizer = (root_ / "a" / "tokenizer.model").string();
  auto b = prepare_corpus(o);
  EXPECT_FALSE(b.set.tokenizer_trained);
  EXPECT_EQ(a.set.tokenizer_hash, b.set.tokenizer_hash);
  EXPECT_EQ(a.set.train_tokens, b.set.train_tokens);
}

TEST_F(PrepareTest, OutputFolderWithForeignFilesIsRefused) {
  auto c = make_corpus(root_ / "corpus", 10);
  fs::create_directories(root_ / "out");
  test::write_text(root_ / "out" / "notes.txt", "mine");
  PrepareOptions o;
  o.inputs = {c.dir.string()};
  o.out_dir = root_ / "out";
  o.vocab_size = 400;
  EXPECT_THROW(prepare_corpus(o), IoError);
  EXPECT_TRUE(fs::exists(root_ / "out" / "notes.txt"));
}

// A shard set is replaced only when asked: runs and checkpoints made from it need its tokenizer.
TEST_F(PrepareTest, AnExistingShardSetIsReplacedOnlyWithOverwrite) {
  PrepareOptions o = options(20);
  const auto first = prepare_corpus(o);
  const auto manifest_before = test::read_text(root_ / "out" / "manifest.json");
  o.seed += 1;  // another split: a replacement would show
  try {
    prepare_corpus(o);
    ADD_FAILURE() << "an existing shard set was replaced without --overwrite";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--overwrite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::read_text(root_ / "out" / "manifest.json"), manifest_before) << "nothing may change";
  o.overwrite = true;
  const auto second = prepare_corpus(o);
  EXPECT_NE(second.set.validation_document_ids, first.set.validation_document_ids);
}

TEST_F(PrepareTest, CliPreparesShardsThatTrainTinyRunsOn) {
  auto c = make_corpus(root_ / "corpus", 150);
  const fs::path out = root_ / "shards";
  auto r = run_loom("prepare --input " + c.dir.string() + " --out " + out.string() +
                    " --vocab-size 512 --val-fraction 0.1 --threads 1 --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["vocab_size"], 512);
  EXPECT_GT(j["tokens"]["validation"].get<int64_t>(), 65);
  EXPECT_NE(r.err.find("corpus: 3 text files"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("done in"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(out / "manifest.json"));

  const std::string train =
      "train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set data.source=shards --set data.dir=" + out.string() +
      " --set train.steps=3 --set train.eval_every=3 --set train.eval_batches=1 --set trace.summary=false --set "
      "checkpoint.dir=" +
      (root_ / "ckpt").string() + " --set train.out_dir=" + (root_ / "run").string();
  auto t = run_loom(train + " --json");
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.err.find("shards '" + out.string()), std::string::npos) << t.err;
  EXPECT_NE(t.err.find("step 3/3"), std::string::npos) << t.err;
  EXPECT_TRUE(nlohmann::json::parse(t.out).contains("val_loss"));

  auto bad = run_loom(train + " --set model.vocab_size=1024");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find("1024"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("512"), std::string::npos) << bad.err;

  auto quiet = run_loom("prepare --input " + c.dir.string() + " --out " + (root_ / "q").string() +
                        " --vocab-size 512 --threads 1 --quiet");
  EXPECT_EQ(quiet.rc, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");

  auto missing = run_loom("prepare --input " + (root_ / "nope").string() + " --out " + (root_ / "x").string());
  EXPECT_EQ(missing.rc, 1);
  EXPECT_NE(missing.err.find("does not exist"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace loom::train
