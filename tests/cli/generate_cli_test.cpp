#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "cli_runner.h"

namespace fs = std::filesystem;
using loom::test::run_loom;

TEST(GenerateCli, SamplesTokenIdsFromASyntheticCheckpointReproduciblyBySeed) {
  auto root = loom::test::scratch_dir("gen");
  auto train = run_loom("train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set train.steps=30 --set train.eval_every=0 "
                        "--set train.out_dir=" + (root / "out").string() + " --save-dir " + (root / "ck").string() +
                        " --save-every 30 --quiet");
  ASSERT_EQ(train.rc, 0) << train.err;
  auto gen = [&](const std::string& extra) {
    return run_loom("generate --checkpoint " + (root / "ck").string() + " --prompt-ids \"5 6 7\" --max-tokens 12 " + extra);
  };
  auto a = gen("--seed 3"), b = gen("--seed 3"), greedy = gen("--temperature 0");
  ASSERT_EQ(a.rc, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  std::istringstream in(greedy.out);
  int id, n = 0;
  while (in >> id) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 512);
    ++n;
  }
  EXPECT_EQ(n, 12);
  EXPECT_NE(a.err.find("KV cache"), std::string::npos) << a.err;
  // Text prompts need the tokenizer a prepared corpus brings.
  auto text = run_loom("generate --checkpoint " + (root / "ck").string() + " --prompt hello");
  EXPECT_EQ(text.rc, 1);
  EXPECT_NE(text.err.find("--prompt-ids"), std::string::npos) << text.err;
  auto none = run_loom("generate --checkpoint " + (root / "nothing").string() + " --prompt-ids 1");
  EXPECT_EQ(none.rc, 1);
  EXPECT_NE(none.err.find("no checkpoint"), std::string::npos) << none.err;
  fs::remove_all(root);
}
