#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/model/generator.h"
#include "loom/model/sampling.h"
#include "loom/model/transformer.h"

using namespace loom;
using namespace loom::model;

class GeneratorCache : public ::testing::TestWithParam<std::string> {};

// The KV-cached decoder must give, at every position, the logits of a full forward pass over the
// whole prefix: the cache changes the cost, never the numbers.
TEST_P(GeneratorCache, IncrementalLogitsMatchAFullForwardAtEveryPosition) {
  const uint32_t seed = 31;
  auto cfg = spec::preset(GetParam());
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, 2);
  ParameterStore params(spec::build_param_table(cfg), Precision::FP32, alloc);
  params.initialize(seed);
  const int64_t T = 24;
  Tensor tokens = Tensor::empty({1, T}, DType::I32, alloc, MemCategory::Activations);
  Tensor targets = Tensor::zeros({1, T}, DType::I32, alloc, MemCategory::Activations);
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < T; ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
  Transformer full(cfg, params, backend);
  auto ctx = full.make_context(1, T);
  full.forward(ctx, tokens, targets, 0.0f);

  Generator gen(cfg, params, backend);
  const int32_t* tk = tokens.data<int32_t>();
  const int64_t prompt = 5;
  auto logits = gen.feed({tk, static_cast<size_t>(prompt)});  // a prompt in one go, then one token at a time
  for (int64_t t = prompt - 1; t < T; ++t) {
    if (t >= prompt) logits = gen.feed({tk + t, 1});
    const float* ref = ctx.logits.data<float>() + t * cfg.vocab_size;
    double worst = 0;
    for (int64_t v = 0; v < cfg.vocab_size; ++v) worst = std::max(worst, double(std::abs(logits[v] - ref[v])));
    EXPECT_LT(worst, 2e-4) << "position " << t << " seed " << seed;
  }
  EXPECT_EQ(gen.position(), T);
  EXPECT_EQ(gen.rows_computed(), T) << "each token goes through the blocks once";
}

// tiny-moe: the experts route each token alike whether it is fed with the prompt or alone (dropless).
INSTANTIATE_TEST_SUITE_P(BothStyles, GeneratorCache, ::testing::Values("tiny", "tiny-llama", "tiny-moe"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(Generator, RefusesToRunPastTheContext) {
  auto cfg = spec::preset("tiny");
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, 1);
  ParameterStore params(spec::build_param_table(cfg), Precision::FP32, alloc);
  params.initialize(1);
  Generator gen(cfg, params, backend);
  std::vector<int32_t> many(static_cast<size_t>(cfg.max_seq + 1), 3);
  EXPECT_THROW(gen.feed(many), ConfigError);
  std::vector<int32_t> bad = {static_cast<int32_t>(cfg.vocab_size)};
  EXPECT_THROW(gen.feed(bad), ConfigError);
}

TEST(Sampling, GreedyTopKAndSeedsBehave) {
  std::vector<float> logits = {0.1f, 3.0f, 2.9f, -1.0f, 2.95f};
  EXPECT_EQ(sample_token(logits, {0.0f, 0, 1}, 0), 1);
  // top-k 1 is greedy whatever the temperature.
  for (uint64_t i = 0; i < 20; ++i) EXPECT_EQ(sample_token(logits, {1.5f, 1, 7}, i), 1);
  // top-k 3 never picks outside the three best.
  for (uint64_t i = 0; i < 200; ++i) {
    int32_t t = sample_token(logits, {2.0f, 3, 7}, i);
    EXPECT_TRUE(t == 1 || t == 2 || t == 4) << t;
  }
  EXPECT_EQ(sample_token(logits, {1.0f, 0, 9}, 5), sample_token(logits, {1.0f, 0, 9}, 5));
  EXPECT_THROW(sample_token(logits, {-1.0f, 0, 1}, 0), ConfigError);
}
