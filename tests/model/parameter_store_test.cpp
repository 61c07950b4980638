// Initialisation is keyed by (seed, parameter name, element of the whole tensor), so a tensor-parallel
// shard holds exactly the numbers the whole model holds at the same global elements: the same model
// under every layout (padding of a vocabulary tp does not divide stays zero).
#include "loom/model/parameter_store.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "loom/core/allocator.h"
#include "loom/core/bf16.h"
#include "loom/spec/param_table.h"

namespace {

using namespace loom;

// The sharded models the tests below check: GPT-2 and Llama style (at tp 4 with a single, replicated KV
// head), a vocabulary tp divides and one it does not (padded), untied heads; f(config, tp, label).
template <class F>
void for_each_sharded_model(bool replicated_kv, F&& f) {
  for (const char* preset : {"tiny", "tiny-llama"})
    for (int tp : {2, 4})
      for (int64_t vocab : {512, 509}) {
        auto c = spec::preset(preset);
        c.vocab_size = vocab;
        c.tie_embeddings = false;
        if (replicated_kv && tp == 4 && std::string(preset) == "tiny-llama") c.n_kv_heads = 1;
        f(c, tp, std::string(preset) + " tp=" + std::to_string(tp) + " V=" + std::to_string(vocab));
      }
}

TEST(ParameterStore, EveryTpShardIsInitialisedWithTheWholeModelsNumbers) {
  for_each_sharded_model(false, [](const spec::TransformerConfig& c, int tp, const std::string& what) {
    Allocator alloc;
    model::ParameterStore whole(spec::build_param_table(c), model::Precision::FP32, alloc);
    whole.initialize(42);
    for (int r = 0; r < tp; ++r) {
      model::ParameterStore shard(spec::build_param_table(c, spec::TableShard{r, tp}), model::Precision::FP32, alloc);
      shard.initialize(42);
      const auto& table = shard.table();
      for (const auto& p : table.params()) {
        const float* mine = shard.param(p.name).data<float>();
        const float* all = whole.param(p.name).data<float>();
        for (int64_t i = 0; i < p.numel(); ++i) {
          const int64_t g = table.global_element(p, i);
          ASSERT_EQ(mine[i], g < 0 ? 0.0f : all[g]) << what << " rank " << r << " " << p.name << "[" << i << "]";
        }
      }
    }
  });
}

// precision = "bf16-sr": the bf16 copies are rounded stochastically keyed by (seed, update step,
// parameter, global element), so every tp shard's copy holds, bit for bit, the whole model's copy of
// the same global elements -- also of elements whose rows a shard splits into pieces (fused QKV, the
// MLP of tiny-llama, a padded vocabulary) -- and the rounding really is stochastic (a different step
// rounds some elements the other way; round-to-nearest agrees with neither everywhere).
TEST(ParameterStore, StochasticallyRoundedCopiesAreTheSameOnEveryTpShard) {
  for_each_sharded_model(true, [](const spec::TransformerConfig& c, int tp, const std::string& what) {
    Allocator alloc;
    model::ParameterStore whole(spec::build_param_table(c), model::Precision::BF16, alloc);
    whole.initialize(42);
    whole.use_stochastic_rounding(7);
    whole.set_rounding_step(3);
    whole.refresh_lowp();
    for (int r = 0; r < tp; ++r) {
      model::ParameterStore shard(spec::build_param_table(c, spec::TableShard{r, tp}), model::Precision::BF16, alloc);
      shard.initialize(42);
      shard.use_stochastic_rounding(7);
      shard.set_rounding_step(3);
      shard.refresh_lowp();
      const auto& table = shard.table();
      for (const auto& p : table.params()) {
        const bf16* mine = shard.lowp().data<bf16>() + p.offset;
        const bf16* all = whole.lowp().data<bf16>() + whole.table().at(p.name).offset;
        for (int64_t i = 0; i < p.numel(); ++i) {
          const int64_t g = table.global_element(p, i);
          ASSERT_EQ(mine[i].bits, g < 0 ? uint16_t{0} : all[g].bits)
              << what << " rank " << r << " " << p.name << "[" << i << "]";
        }
      }
    }
    // Stochastic: another step's key rounds part of the elements differently, and nearest-even
    // rounding is not what either step wrote.
    model::ParameterStore other(spec::build_param_table(c), model::Precision::BF16, alloc);
    other.initialize(42);
    other.use_stochastic_rounding(7);
    other.set_rounding_step(4);
    other.refresh_lowp();
    model::ParameterStore nearest(spec::build_param_table(c), model::Precision::BF16, alloc);
    nearest.initialize(42);
    nearest.refresh_lowp();
    int64_t differ = 0, from_nearest = 0;
    const int64_t n = whole.lowp().numel();
    for (int64_t i = 0; i < n; ++i) {
      differ += whole.lowp().data<bf16>()[i].bits != other.lowp().data<bf16>()[i].bits;
      from_nearest += whole.lowp().data<bf16>()[i].bits != nearest.lowp().data<bf16>()[i].bits;
    }
    EXPECT_GT(differ, n / 10) << what;
    EXPECT_GT(from_nearest, n / 10) << what;
  });
}

// The runs a shard's elements are visited in for element-wise randomness map each element to the same
// global element as global_element does, one by one.
TEST(ParamTable, GlobalRunsMapEveryElementLikeGlobalElement) {
  for (const char* preset : {"tiny", "tiny-llama"})
    for (int tp : {1, 2, 4})
      for (int64_t vocab : {512, 509}) {
        auto c = spec::preset(preset);
        c.vocab_size = vocab;
        if (tp == 4 && std::string(preset) == "tiny-llama") c.n_kv_heads = 1;
        for (int r = 0; r < tp; ++r) {
          const auto table = spec::build_param_table(c, spec::TableShard{r, tp});
          for (const auto& p : table.params())
            for (auto [b, e] : {std::pair<int64_t, int64_t>{0, p.numel()}, {p.numel() / 3, p.numel() - 5}}) {
              int64_t next = b;
              table.for_each_global_run(p, b, e, [&](int64_t local, int64_t global, int64_t n) {
                ASSERT_EQ(local, next);
                ASSERT_GT(n, 0);
                for (int64_t k = 0; k < n; ++k) {
                  const int64_t want = table.global_element(p, local + k);
                  ASSERT_EQ(global < 0 ? -1 : global + k, want)
                      << p.name << " tp=" << tp << " rank " << r << " [" << local + k << "]";
                }
                next = local + n;
              });
              ASSERT_EQ(next, std::max(b, e)) << p.name;
            }
        }
      }
}

}  // namespace
