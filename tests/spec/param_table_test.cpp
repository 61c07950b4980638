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
