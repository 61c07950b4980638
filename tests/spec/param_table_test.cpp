#include <gtest/gtest.h>

#include <cmath>

#include "loom/error.h"
#include "loom/spec/param_table.h"
#include "loom/spec/transformer_config.h"

using namespace loom;
using namespace loom::spec;

TEST(Presets, MiniHasTenToFifteenMillionParametersAndTheDocumentedShape) {
  auto c = preset("mini");
  EXPECT_EQ(c.d_model, 384);
  EXPECT_EQ(c.n_layers, 6);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.max_seq, 256);
  auto t = build_param_table(c);
  EXPECT_GE(t.total_numel(), 10'000'000);
  EXPECT_LE(t.total_numel(), 15'000'000);
}

TEST(Presets, Gpt2SmallMatchesTheHuggingFaceParameterCount) {
  // GPT-2 small has 124,439,808 parameters (tied LM head) in Hugging Face's GPT2LMHeadModel.
  auto t = build_param_table(preset("gpt2-124m"));
  int64_t n = 0;
  for (auto& p : t.params()) n += p.numel();
  EXPECT_EQ(n, 124'439'808);
}

TEST(Presets, EveryPresetValidatesAndUnknownNamesListTheValidOnes) {
  for (auto& name : preset_names()) EXPECT_NO_THROW(build_param_table(preset(name))) << name;
  try {
    preset("gpt5");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("mini"), std::string::npos);
  }
}

TEST(TransformerConfig, RejectsHeadsThatDoNotDivideTheWidth) {
  auto c = preset("tiny");
  c.n_heads = 5;
  c.n_kv_heads = 5;
  EXPECT_THROW(c.validate(), ConfigError);
  auto l = preset("tiny-llama");
  l.n_kv_heads = 3;
  EXPECT_THROW(l.validate(), ConfigError);
  auto g = preset("tiny");
  g.n_kv_heads = 2;  // GQA only for llama
  EXPECT_THROW(g.validate(), ConfigError);
}

TEST(ParamTable, UsesHuggingFaceNamesAndLinearLayout) {
  auto t = build_param_table(preset("tiny"));
  auto& qkv = t.at("transformer.h.1.attn.c_attn.weight");
  EXPECT_EQ(qkv.shape, (std::vector<int64_t>{3 * 64, 64}));
  EXPECT_TRUE(t.index_of("transformer.ln_f.bias").has_value());
  EXPECT_FALSE(t.index_of("lm_head.weight").has_value());  // tied
  auto l = build_param_table(preset("tiny-llama"));
  EXPECT_EQ(l.at("model.layers.0.self_attn.k_proj.weight").shape, (std::vector<int64_t>{2 * 16, 64}));
  EXPECT_TRUE(l.index_of("lm_head.weight").has_value());
}

TEST(ParamTable, WeightDecayOnlyOnMatrices) {
  for (auto name : {"tiny", "tiny-llama"}) {
    auto t = build_param_table(preset(name));
    for (auto& p : t.params()) EXPECT_EQ(p.weight_decay, p.shape.size() == 2) << p.name;
  }
}

TEST(ParamTable, ResidualProjectionsUseScaledInit) {
  auto c = preset("tiny");
  auto t = build_param_table(c);
  EXPECT_FLOAT_EQ(t.at("transformer.h.0.attn.c_proj.weight").init.std, 0.02f / std::sqrt(2.0f * c.n_layers));
  EXPECT_FLOAT_EQ(t.at("transformer.h.0.attn.c_attn.weight").init.std, 0.02f);
}

TEST(ParamTable, FusedProjectionsAreAdjacentAndAligned) {
  auto t = build_param_table(preset("llama-mini"));
  auto& q = t.at("model.layers.3.self_attn.q_proj.weight");
  auto& k = t.at("model.layers.3.self_attn.k_proj.weight");
  auto& v = t.at("model.layers.3.self_attn.v_proj.weight");
  EXPECT_EQ(k.offset, q.offset + q.numel());
  EXPECT_EQ(v.offset, k.offset + k.numel());
  for (auto& p : t.params()) EXPECT_EQ(p.offset % 16, 0) << p.name;
  EXPECT_TRUE(t.at("model.norm.weight").placement.is_replicated());
}

TEST(ModelFlops, CountsSixTimesDenseParametersPlusCausalAttention) {
  auto c = preset("mini");
  auto t = build_param_table(c);
  double expected = 6.0 * (t.non_embedding_numel() + c.vocab_size * c.d_model) + 6.0 * c.n_layers * 256 * c.d_model;
  EXPECT_DOUBLE_EQ(model_flops_per_token(c, 256), expected);
}

// ---- tensor-parallel shards of the table -------------------------------------------------------------

namespace {
// How often each element of the whole tensor `name` is held by the tp ranks' shards.
std::vector<int> coverage(const TransformerConfig& c, int tp, const std::string& name) {
  const auto whole = build_param_table(c);
  std::vector<int> seen(static_cast<size_t>(whole.at(name).numel()), 0);
  for (int r = 0; r < tp; ++r) {
    const auto t = build_param_table(c, TableShard{r, tp});
    const auto& p = t.at(name);
    EXPECT_EQ(p.global_shape, whole.at(name).shape) << name;
    for (int64_t i = 0; i < p.numel(); ++i) {
      const int64_t g = t.global_element(p, i);
      if (g >= 0) ++seen.at(static_cast<size_t>(g));
    }
  }
  return seen;
}
}  // namespace

TEST(ParamTableShard, ColumnAndRowParallelTensorsHaveLocalShapesAndKeepTheirGlobalOnes) {
  const auto c = preset("tiny");  // C = 64, H = 4, d_ff = 256, V = 512
  const auto t = build_param_table(c, TableShard{1, 2});
  EXPECT_EQ(t.at("transformer.h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{96, 64}));
  EXPECT_EQ(t.at("transformer.h.0.attn.c_attn.weight").global_shape, (std::vector<int64_t>{192, 64}));
  EXPECT_EQ(t.at("transformer.h.0.attn.c_attn.bias").shape, (std::vector<int64_t>{96}));
  EXPECT_EQ(t.at("transformer.h.0.attn.c_proj.weight").shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(t.at("transformer.h.0.attn.c_proj.bias").shape, (std::vector<int64_t>{64}));  // after the reduction
  EXPECT_EQ(t.at("transformer.h.0.mlp.c_fc.weight").shape, (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(t.at("transformer.h.0.mlp.c_proj.weight").shape, (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(t.at("transformer.wte.weight").shape, (std::vector<int64_t>{256, 64}));  // vocabulary-parallel
  EXPECT_EQ(t.at("transformer.wpe.weight").shape, (std::vector<int64_t>{64, 64}));
  EXPECT_TRUE(t.at("transformer.h.0.ln_1.weight").placement.is_replicated());
  EXPECT_EQ(t.at("transformer.h.0.attn.c_proj.weight").placement.str(), "tp:Shard(1)");
  EXPECT_EQ(t.at("transformer.h.0.attn.c_attn.weight").placement.str(), "tp:Shard(0, 3 blocks)");
  // The whole-model table is what it always was.
  const auto whole = build_param_table(c);
  EXPECT_EQ(whole.at("transformer.h.0.attn.c_attn.weight").shape, whole.at("transformer.h.0.attn.c_attn.weight").global_shape);
}

TEST(ParamTableShard, EveryGlobalElementIsHeldByExactlyOneTpRank) {
  for (const char* name : {"tiny", "tiny-llama", "tiny-moe"})  // tiny-moe: the experts split by width
    for (int tp : {2, 4}) {
      const auto c = preset(name);
      const auto first = build_param_table(c, TableShard{0, tp});
      for (const auto& p : first.params()) {
        // Replicated over some ranks on purpose (KV heads at tp > n_kv_heads): FewerKvHeads... below.
        if (!p.placement.on(MeshAxis::TP).is_shard() || p.placement.on(MeshAxis::TP).pieces > 0) continue;
        const auto seen = coverage(c, tp, p.name);
        for (size_t g = 0; g < seen.size(); ++g) ASSERT_EQ(seen[g], 1) << name << " tp=" << tp << " " << p.name << "[" << g << "]";
      }
    }
}

TEST(ParamTableShard, Gpt2FusedQkvIsSplitPerProjectionNotByRowsOfTheFusedMatrix) {
  const auto c = preset("tiny");  // C = 64: q rows 0..63, k 64..127, v 128..191
  const auto t = build_param_table(c, TableShard{1, 2});
  const auto& p = t.at("transformer.h.0.attn.c_attn.weight");
  auto global_row = [&](int64_t local_row) { return t.global_element(p, local_row * 64) / 64; };
  EXPECT_EQ(global_row(0), 32);    // rank 1's first q row: the second half of q
  EXPECT_EQ(global_row(31), 63);
  EXPECT_EQ(global_row(32), 96);   // then its half of k
  EXPECT_EQ(global_row(64), 160);  // and of v
  EXPECT_EQ(t.global_element(p, 5), 32 * 64 + 5);
}

TEST(ParamTableShard, FewerKvHeadsThanTpAreReplicatedOverTheRanksThatShareThem) {
  auto c = preset("tiny-llama");  // H = 4, KV = 2
  c.n_kv_heads = 1;
  const auto seen = coverage(c, 4, "model.layers.0.self_attn.k_proj.weight");
  for (int n : seen) ASSERT_EQ(n, 4);  // the one KV head on every rank
  c.n_kv_heads = 2;
  for (int n : coverage(c, 4, "model.layers.0.self_attn.v_proj.weight")) ASSERT_EQ(n, 2);  // each on two ranks
  const auto t = build_param_table(c, TableShard{3, 4});
  EXPECT_EQ(t.at("model.layers.0.self_attn.k_proj.weight").shape, (std::vector<int64_t>{16, 64}));  // one head
  EXPECT_EQ(t.global_element(t.at("model.layers.0.self_attn.k_proj.weight"), 0), 16 * 64);  // head 1: ranks 2-3
}

TEST(ParamTableShard, AVocabularyTpDoesNotDivideIsPaddedNotRefused) {
  auto c = preset("tiny");
  c.vocab_size = 513;
  const auto t = build_param_table(c, TableShard{1, 2});
  const auto& wte = t.at("transformer.wte.weight");
  EXPECT_EQ(wte.shape, (std::vector<int64_t>{257, 64}));  // rows 257..512 and one row of padding
  EXPECT_EQ(t.global_element(wte, 0), 257 * 64);
  EXPECT_EQ(t.global_element(wte, 255 * 64 + 3), 512 * 64 + 3);  // the last real row
  EXPECT_EQ(t.global_element(wte, 256 * 64), -1);               // padding
  const auto t0 = build_param_table(c, TableShard{0, 2});
  EXPECT_EQ(t0.global_element(t0.at("transformer.wte.weight"), 256 * 64), 256 * 64);
  c.vocab_size = 511;
  const auto t1 = build_param_table(c, TableShard{1, 2});
  EXPECT_EQ(t1.global_element(t1.at("transformer.wte.weight"), 254 * 64), 510 * 64);
  EXPECT_EQ(t1.global_element(t1.at("transformer.wte.weight"), 255 * 64), -1);  // padding
  for (int n : coverage(c, 2, "transformer.wte.weight")) ASSERT_EQ(n, 1);
}

TEST(ParamTableShard, WidthsTpCannotSplitAreRefusedNamingTheNumbersAndValidDegrees) {
  auto error = [](const TransformerConfig& c, int tp) {
    try {
      build_param_table(c, TableShard{0, tp});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const auto mini = preset("mini");  // H = 6
  EXPECT_NE(error(mini, 4).find("parallel.tp = 4 does not divide model.n_heads = 6"), std::string::npos);
  EXPECT_NE(error(mini, 4).find("valid tp: 1, 2, 3, 6"), std::string::npos);
  auto l = preset("llama-mini");  // H = 6, KV = 2
  EXPECT_NE(error(l, 3).find("model.n_kv_heads = 2"), std::string::npos) << error(l, 3);
  auto f = preset("tiny");
  f.d_ff = 258;
  EXPECT_NE(error(f, 4).find("model.d_ff = 258"), std::string::npos) << error(f, 4);
  EXPECT_EQ(error(preset("tiny"), 4), "");
}

namespace loom::spec {
namespace {

// A gradient norm over tp shards must count every element of the whole model exactly once: replicated
// norms and biases on one rank, a KV head shared by tp / n_kv_heads ranks on one of them, padding nowhere.
TEST(ParamTableShard, CountedRangesCountEveryGlobalElementExactlyOnce) {
  struct Case {
    const char* preset;
    int64_t kv, vocab;
  };
  for (auto [name, kv, vocab] : {Case{"tiny", 0, 513}, Case{"tiny-llama", 2, 512}, Case{"tiny-llama", 1, 511}})
    for (int tp : {1, 2, 4}) {
      auto c = preset(name);
      if (kv) c.n_kv_heads = kv;
      c.vocab_size = vocab;
      const auto whole = build_param_table(c);
      std::vector<int> counted(static_cast<size_t>(whole.total_numel()), 0);
      for (int r = 0; r < tp; ++r) {
        const auto t = build_param_table(c, TableShard{r, tp});
        const auto ranges = counted_ranges(t);
        for (const auto& p : t.params())
          for (const auto& range : intersect(ranges, {{p.offset, p.offset + p.numel()}}))
            for (int64_t a = range.begin; a < range.end; ++a)
              if (const int64_t g = t.global_element(p, a - p.offset); g >= 0)
                ++counted.at(static_cast<size_t>(whole.at(p.name).offset + g));
      }
      for (size_t i = 0; i < counted.size(); ++i)
        ASSERT_EQ(counted[i], 1) << name << " kv=" << kv << " tp=" << tp << " element " << i;
    }
}

// Under tp every expert splits like a dense SwiGLU MLP (gate and up by rows, down by columns); the
// router and the selection bias stay whole on every rank.
TEST(ParamTableShard, ExpertsSplitByWidthAndTheRouterStaysWhole) {
  auto c = preset("tiny-moe");
  c.moe.shared_experts = 1, c.moe.bias_update_rate = 0.01;
  const auto t = build_param_table(c, TableShard{1, 2});
  const std::string x = "model.layers.1.block_sparse_moe.";
  EXPECT_EQ(t.at(x + "experts.3.w1.weight").shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(t.at(x + "experts.3.w3.weight").placement.str(), "tp:Shard(0)");
  EXPECT_EQ(t.at(x + "experts.3.w2.weight").shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(t.at(x + "experts.3.w2.weight").placement.str(), "tp:Shard(1)");
  EXPECT_EQ(t.at(x + "shared_experts.down_proj.weight").placement.str(), "tp:Shard(1)");
  EXPECT_EQ(t.at(x + "gate.weight").shape, (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(t.at(x + "gate.e_score_correction_bias").placement.str(), "Replicate");
  c.moe.d_expert = 130;
  try {
    build_param_table(c, TableShard{0, 4});
    FAIL() << "an expert width tp does not divide";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.tp = 4 does not divide the expert width 130"), std::string::npos) << e.what();
  }
}

// The expert side of expert parallelism holds every rank's rows for this rank's experts: all of them
// when dropless, at most each expert's capacity from each rank otherwise -- whatever ep is.
TEST(MoeConfig, TheExpertSideHoldsAtMostEveryExpertsCapacity) {
  MoeConfig m;
  m.experts = 8, m.top_k = 2;
  EXPECT_EQ(m.capacity(512), 1024) << "dropless: every pair";
  EXPECT_EQ(m.expert_side_rows(512, 1), 1024);
  EXPECT_EQ(m.expert_side_rows(512, 4), 4 * 1024) << "dropless: all of them could come here";
  m.capacity_factor = 1.25;
  EXPECT_EQ(m.capacity(512), 160);  // ceil(1.25 x 1024 / 8)
  EXPECT_EQ(m.expert_side_rows(512, 1), 1024);
  for (int ep : {2, 4, 8}) EXPECT_EQ(m.expert_side_rows(512, ep), 8 * 160) << "ep " << ep;
  m.capacity_factor = 100;
  EXPECT_EQ(m.capacity(512), 1024) << "never more than the pairs";
  EXPECT_EQ(m.expert_side_rows(512, 2), 2 * 1024);
}

TEST(ArenaRanges, IntersectKeepsOnlyCommonElements) {
  const std::vector<ArenaRange> a{{0, 10}, {20, 30}}, b{{5, 25}, {28, 40}};
  EXPECT_EQ(intersect(a, b), (std::vector<ArenaRange>{{5, 10}, {20, 25}, {28, 30}}));
  EXPECT_TRUE(intersect(a, {}).empty());
}

}  // namespace
}  // namespace loom::spec
