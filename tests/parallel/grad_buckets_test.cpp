// Data-parallel gradient buckets: how the arena is cut, and that a bucket is reduced only once final.
#include "loom/parallel/grad_buckets.h"

#include <gtest/gtest.h>

#include <set>

#include "loom/comm/world.h"
#include "loom/spec/param_table.h"

namespace loom::parallel {
namespace {

std::unique_ptr<comm::World> one_rank_world() {
  return comm::World::join(comm::read_job_env(std::map<std::string, std::string>{}), comm::CommOptions{});
}

TEST(GradBuckets, CoverTheArenaFromTheEndInWholeParametersOfAtLeastTheTargetSize) {
  const auto table = spec::build_param_table(spec::preset("tiny"));
  auto world = one_rank_world();
  std::vector<float> grads(table.total_numel(), 1.0f);
  const size_t target = 64 << 10;
  GradBuckets b(table, grads.data(), world->group(), target);
  ASSERT_GT(b.buckets(), 2u);
  std::set<int64_t> starts;
  for (const auto& p : table.params()) starts.insert(p.offset);
  int64_t hi = table.total_numel();
  for (size_t i = 0; i < b.buckets(); ++i) {
    const int64_t lo = b.bucket_begin(i);
    EXPECT_TRUE(starts.contains(lo)) << "bucket " << i << " does not start at a parameter";
    if (lo > 0) {
      EXPECT_GE((hi - lo) * 4, static_cast<int64_t>(target)) << "bucket " << i;
    }
    EXPECT_LT(lo, hi);
    hi = lo;
  }
  EXPECT_EQ(hi, 0);
}

TEST(GradBuckets, ABucketIsReducedOnlyWhenWhollyFinalAndAllByFinish) {
  const auto cfg = spec::preset("tiny");
  const auto table = spec::build_param_table(cfg);
  auto world = one_rank_world();
  std::vector<float> grads(table.total_numel(), 2.0f);
  GradBuckets b(table, grads.data(), world->group(), 16 << 10);
  const auto starts = table.block_starts(cfg.n_layers);
  b.begin();
  b.ready_from(table.total_numel());  // nothing final yet
  EXPECT_EQ(b.issued(), 0u);
  b.ready_from(starts[cfg.n_layers - 1]);  // the last block and everything after it
  size_t expected = 0;
  for (size_t i = 0; i < b.buckets(); ++i) expected += b.bucket_begin(i) >= starts[cfg.n_layers - 1];
  EXPECT_GT(expected, 0u);
  EXPECT_EQ(b.issued(), expected);
  b.finish();
  EXPECT_EQ(b.issued(), b.buckets());
  for (float g : grads) ASSERT_EQ(g, 2.0f);  // a one-rank sum leaves the values alone
}

TEST(ParamTable, BlockStartsAreTheFirstParameterOfEachBlockAndTheEndOfTheBlocks) {
  for (const char* name : {"tiny", "tiny-llama"}) {
    const auto cfg = spec::preset(name);
    const auto table = spec::build_param_table(cfg);
    const auto starts = table.block_starts(cfg.n_layers);
    ASSERT_EQ(static_cast<int64_t>(starts.size()), cfg.n_layers + 1);
    for (int64_t l = 0; l + 1 < static_cast<int64_t>(starts.size()); ++l) EXPECT_LT(starts[l], starts[l + 1]) << name;
    EXPECT_GT(starts[0], 0) << "embeddings come first";
    EXPECT_LT(starts[cfg.n_layers], table.total_numel()) << "the final norm comes after the blocks";
  }
}

}  // namespace
}  // namespace loom::parallel
