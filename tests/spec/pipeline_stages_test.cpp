// Cutting the blocks into pipeline chunks: balanced by declared cost by default (the head's cost
// weighs on the last chunk), explicit uneven splits as real runs use, one-line refusals otherwise.
#include "loom/spec/pipeline_stages.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "loom/error.h"

namespace loom::spec {
namespace {

using ::testing::HasSubstr;

// Stacks cut blocks that pp x v does not divide with the lighter chunks at the two ends.
TEST(PipelineStages, TrimmedEndsAreAsEvenAsPossibleWithTheLightChunksOutermost) {
  std::vector<int64_t> llama405{7};
  for (int i = 0; i < 14; ++i) llama405.push_back(8);
  llama405.push_back(7);
  EXPECT_EQ(trimmed_ends(126, 16), llama405);
  EXPECT_EQ(trimmed_ends(126, 5), (std::vector<int64_t>{25, 25, 26, 25, 25}));
  EXPECT_EQ(trimmed_ends(10, 4), (std::vector<int64_t>{2, 3, 3, 2}));
  EXPECT_EQ(trimmed_ends(12, 4), (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(trimmed_ends(3, 3), (std::vector<int64_t>{1, 1, 1}));
  for (int64_t L : {7, 31, 126})
    for (int K = 1; K <= L; K += 3) {
      const auto cut = trimmed_ends(L, K);
      ASSERT_EQ(static_cast<int>(cut.size()), K);
      EXPECT_EQ(std::accumulate(cut.begin(), cut.end(), int64_t{0}), L);
      EXPECT_LE(*std::max_element(cut.begin(), cut.end()) - *std::min_element(cut.begin(), cut.end()), 1);
      EXPECT_EQ(cut.front(), *std::min_element(cut.begin(), cut.end()));
    }
  try {
    trimmed_ends(3, 4);
    ADD_FAILURE() << "4 chunks of 3 blocks";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("3 blocks cannot be cut into 4 pipeline chunks"));
  }
}

TEST(PipelineStages, DefaultSplitCoversEveryBlockAndBalancesTheCost) {
  for (const char* name : {"tiny", "mini", "gpt2-124m", "llama-mini"})
    for (int pp : {1, 2, 3, 4})
      for (int v : {1, 2}) {
        const auto cfg = preset(name);
        if (cfg.n_layers < pp * v) continue;
        const auto s = cut_pipeline(cfg, cfg.max_seq, pp, v);
        ASSERT_EQ(static_cast<int>(s.layers.size()), pp * v) << name;
        EXPECT_EQ(std::accumulate(s.layers.begin(), s.layers.end(), int64_t{0}), cfg.n_layers) << name;
        for (int64_t n : s.layers) EXPECT_GE(n, 1) << name << " " << s.str();
        // No chunk could give a block to another without the largest cost growing.
        const double b = block_cost(cfg, cfg.max_seq), h = head_cost(cfg);
        double worst = 0;
        for (size_t k = 0; k < s.layers.size(); ++k)
          worst = std::max(worst, b * static_cast<double>(s.layers[k]) + (k + 1 == s.layers.size() ? h : 0));
        const double ideal = (b * static_cast<double>(cfg.n_layers) + h) / (pp * v);
        EXPECT_LE(worst, std::max(ideal + b, h + b)) << name << " pp=" << pp << " v=" << v << " " << s.str();
      }
}

TEST(PipelineStages, AHeavyHeadTakesBlocksOffTheLastStage) {
  auto cfg = preset("tiny");  // 2 blocks of C = 64: a 32k vocabulary's head outweighs a block
  cfg.n_layers = 8;
  cfg.vocab_size = 32768;
  const auto s = cut_pipeline(cfg, 64, 4, 1);
  EXPECT_LT(s.layers.back(), s.layers.front()) << s.str();
  EXPECT_EQ(s.first_layer(2), s.layers[0] + s.layers[1]);
  EXPECT_EQ(s.rank_of(5 % 4), 1);
}

// Interleaved chunks: equal chunks are not enough, each rank's chunks must add up evenly too. mini (6
// blocks, a head worth ~1.8 blocks) on 2 x 2 chunks: 2,2,1,1 leaves rank 1 with 4.8 block costs and rank
// 0 with 3; 2,1,2,1 gives 4 and 3.8 with no chunk heavier than before.
TEST(PipelineStages, VirtualStagesBalanceEachRanksChunksTogether) {
  const auto cfg = preset("mini");
  const auto s = cut_pipeline(cfg, 256, 2, 2);
  EXPECT_EQ(s.str(), "2,1,2,1");
  const double b = block_cost(cfg, 256), h = head_cost(cfg);
  double rank[2] = {0, 0};
  for (int k = 0; k < 4; ++k) rank[k % 2] += b * static_cast<double>(s.layers[static_cast<size_t>(k)]) + (k == 3 ? h : 0);
  EXPECT_LT(std::max(rank[0], rank[1]) / std::min(rank[0], rank[1]), 1.1) << rank[0] << " " << rank[1];
}

TEST(PipelineStages, ExplicitUnevenSplitsAreKept) {
  auto cfg = preset("tiny");
  cfg.n_layers = 126;
  std::vector<int64_t> split(16, 8);
  split.front() = split.back() = 7;  // 7 + 14 x 8 + 7 = 126
  const auto s = cut_pipeline(cfg, 64, 16, 1, split);
  EXPECT_EQ(s.layers, split);
  EXPECT_EQ(s.first_layer(15), 119);
  EXPECT_EQ(parse_layer_counts("7,8,8,7", "k"), (std::vector<int64_t>{7, 8, 8, 7}));
}

TEST(PipelineStages, SplitsThatCannotWorkAreRefusedWithOneThatDoes) {
  const auto cfg = preset("tiny");  // 2 blocks
  auto error = [&](int pp, int v, std::vector<int64_t> layers) {
    try {
      cut_pipeline(cfg, 64, pp, v, layers);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_THAT(error(2, 2, {}), HasSubstr("model.n_layers = 2 cannot give pp x virtual_stages = 2 x 2 = 4 chunks"));
  EXPECT_THAT(error(2, 1, {1}), HasSubstr("lists 1 block counts, but pp x virtual_stages = 2 chunks need one each (e.g. \"1,1\")"));
  EXPECT_THAT(error(2, 1, {1, 2}), HasSubstr("sums to 3 blocks, but model.n_layers = 2"));
  EXPECT_THAT(error(2, 1, {3, -1}), HasSubstr("negative"));
  EXPECT_THROW(parse_layer_counts("7,,8", "parallel.pipeline.layers"), ConfigError);
  EXPECT_THROW(parse_layer_counts("seven", "parallel.pipeline.layers"), ConfigError);
}

}  // namespace
}  // namespace loom::spec
