// Initialisation is keyed by (seed, parameter name, element of the whole tensor), so a tensor-parallel
// shard holds exactly the numbers the whole model holds at the same global elements: the same model
// under every layout (padding of a vocabulary tp does not divide stays zero).
#include <gtest/gtest.h>

#include "loom/core/allocator.h"
#include "loom/model/parameter_store.h"
#include "loom/spec/param_table.h"

namespace {

using namespace loom;

TEST(ParameterStore, EveryTpShardIsInitialisedWithTheWholeModelsNumbers) {
  for (const char* preset : {"tiny", "tiny-llama"})
    for (int tp : {2, 4})
      for (int64_t vocab : {512, 509}) {
        auto c = spec::preset(preset);
        c.vocab_size = vocab;
        c.tie_embeddings = false;
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
              ASSERT_EQ(mine[i], g < 0 ? 0.0f : all[g])
                  << preset << " tp=" << tp << " rank " << r << " V=" << vocab << " " << p.name << "[" << i << "]";
            }
          }
        }
      }
}

}  // namespace
