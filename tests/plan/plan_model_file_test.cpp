// `loom plan --model FILE`: a model that is in no zoo, given as a Hugging Face config.json (GPT-2,
// Llama, Mistral, Mixtral) or as Loom's [model] table in a TOML, with the zoo's validation and
// one-line errors. Known answers: the published configs of GPT-2 124M, Llama 3 8B and Mixtral 8x7B give
// exactly the parameter counts of the same models in the preset and zoo tables.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../cli/cli_runner.h"
#include "loom/error.h"
#include "loom/plan/hf_config.h"
#include "loom/plan/model_zoo.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;

// As published on the Hugging Face hub (fields the shape does not depend on trimmed).
const char* kGpt2 = R"({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
  "n_inner": null, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257})";
const char* kLlama3 = R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false, "hidden_act": "silu",
  "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256})";
const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false, "vocab_size": 32000})";

TEST(ModelFile, PublishedConfigsGiveThePresetAndZooModelsExactly) {
  const auto gpt2 = plan::parse_hf_config(kGpt2, "gpt2/config.json");
  EXPECT_EQ(gpt2.cfg.arch, spec::Arch::GPT2);
  EXPECT_EQ(plan::count_params(gpt2).total, plan::count_params(plan::plan_model("gpt2-124m")).total);
  EXPECT_EQ(gpt2.cfg.d_ff, 3072) << "n_inner null: 4 x n_embd";
  const auto llama = plan::parse_hf_config(kLlama3, "llama3/config.json");
  EXPECT_EQ(plan::count_params(llama).total, plan::count_params(plan::plan_model("llama3-8b")).total);
  EXPECT_EQ(llama.cfg.n_kv_heads, 8);
  const auto mixtral = plan::parse_hf_config(kMixtral, "mixtral/config.json");
  EXPECT_EQ(mixtral.n_experts(), 8);
  EXPECT_EQ(mixtral.top_k(), 2);
  EXPECT_EQ(plan::count_params(mixtral).total, plan::count_params(plan::plan_model("mixtral-8x7b")).total);
  EXPECT_EQ(plan::count_params(mixtral).active, plan::count_params(plan::plan_model("mixtral-8x7b")).active);
  // Exporters that write every number as a float, and GPT-2 configs with only n_ctx, still read.
  std::string floats = kLlama3;
  floats.replace(floats.find("\"hidden_size\": 4096"), 19, "\"hidden_size\": 4096.0");
  EXPECT_EQ(plan::parse_hf_config(floats, "f/config.json").cfg.d_model, 4096);
  std::string ctx = kGpt2;
  ctx.replace(ctx.find("\"n_positions\": 1024, "), 21, "");
  EXPECT_EQ(plan::parse_hf_config(ctx, "c/config.json").cfg.max_seq, 1024);
}

std::string error_of(const std::string& text) {
  try {
    plan::parse_hf_config(text, "m/config.json");
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  return "";
}

TEST(ModelFile, WhatTheBlockDoesNotDescribeIsRefusedNamingTheField) {
  EXPECT_THAT(error_of("[1, 2]"), HasSubstr("not a JSON object"));
  EXPECT_THAT(error_of(R"({"hidden_size": 8})"), HasSubstr("\"model_type\" is missing"));
  EXPECT_THAT(error_of(R"({"model_type": "gemma"})"), HasSubstr("model_type \"gemma\" is not a family"));
  EXPECT_THAT(error_of(R"({"model_type": "llama", "hidden_size": 64})"), HasSubstr("\"num_hidden_layers\" is missing"));
  std::string bad = kLlama3;
  EXPECT_THAT(error_of(bad.replace(bad.find("\"num_hidden_layers\": 32"), 23, "\"num_hidden_layers\": -3")),
              HasSubstr("\"num_hidden_layers\" = -3 must be a positive integer"));
  bad = kLlama3;
  EXPECT_THAT(error_of(bad.replace(bad.find("\"attention_bias\": false"), 23, "\"attention_bias\": true")),
              HasSubstr("no biases"));
  bad = kLlama3;
  EXPECT_THAT(error_of(bad.replace(bad.find('{'), 1, "{\"head_dim\": 256, ")), HasSubstr("\"head_dim\" = 256"));
  bad = kLlama3;
  EXPECT_THAT(error_of(bad.replace(bad.find("\"num_key_value_heads\": 8"), 24, "\"num_key_value_heads\": 5")),
              HasSubstr("m/config.json: "));
  bad = kMixtral;
  EXPECT_THAT(error_of(bad.replace(bad.find("\"num_experts_per_tok\": 2"), 24, "\"num_experts_per_tok\": 9")),
              HasSubstr("more than \"num_local_experts\""));
}

TEST(ModelFile, LoomPlanTakesAConfigJsonOrATomlModelTable) {
  auto dir = scratch_dir("plan-model-file");
  {
    std::ofstream(dir / "config.json") << kLlama3;
    std::ofstream(dir / "narrow.toml") << "[model]\npreset = \"llama-mini\"\nn_layers = 10\nd_model = 512\nn_heads = 8\n";
  }
  auto r = run_loom("plan --model " + (dir / "config.json").string() + " --cluster " LOOM_SOURCE_DIR
                    "/configs/hardware/h100.toml:16 --seq 8192 --global-batch 64 --top 1");
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  auto zoo = run_loom("plan --model llama3-8b --cluster " LOOM_SOURCE_DIR
                      "/configs/hardware/h100.toml:16 --seq 8192 --global-batch 64 --top 1");
  ASSERT_EQ(zoo.rc, 0) << zoo.err;
  // The same model: the same best layout and step time (the table's lines after the header).
  EXPECT_EQ(r.out.substr(r.out.find('\n')), zoo.out.substr(zoo.out.find('\n')));
  r = run_loom("plan --model " + (dir / "narrow.toml").string() + " --cluster a100:8 --seq 256 --global-batch 64 --json");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"layouts\""));
  // The TOML goes through loom train's registry: its keys, ranges and errors.
  {
    std::ofstream(dir / "bad.toml") << "[model]\npreset = \"mini\"\nn_heads = 7\n";
  }
  r = run_loom("plan --model " + (dir / "bad.toml").string() + " --cluster a100:8 --seq 256 --global-batch 64");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("n_heads"));
  r = run_loom("plan --model " + (dir / "missing.json").string() + " --cluster a100:8 --seq 256 --global-batch 64");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("no such file"));
}

}  // namespace
}  // namespace loom::test
