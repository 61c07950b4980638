// Mixture of experts end to end (issue 19): `[model.moe]` models train from the CLI and reproduce the
// single-rank loss under data parallelism (DDP and ZeRO), expert parallelism (alone, with more replicas
// than ep, with pp, under ZeRO 1-3 with the experts sharded over their own group), tensor parallelism
// inside the experts (with SP, ep, ZeRO and pp), pipeline parallelism and recompute, in both
// router styles, both architectures and both precisions; each block's load reaches metrics.jsonl and the
// trace; the auxiliary-loss-free selection bias is a weight like any other (it moves, it resumes
// bitwise, it exports); checkpoints export under Mixtral's names and import back; generation runs from
// an MoE checkpoint, tp-sharded ones included; and what the block does not combine with yet is refused
// in one line.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "loom/core/safetensors.h"
#include "run_metrics.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kTiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml ";

// `loom verify` of `layouts` (the first: one rank) for the MoE models every layout must agree on:
// dropless softmax (Mixtral) in fp32 and bf16, capacity-limited sigmoid with a shared expert and the
// selection bias (DeepSeek-V3), and GPT-2 blocks with MoE on every other block, top-1, capacity and the
// aux loss; two micro-batches per rank, so capacity and the aux loss see the same micro-batches on every
// layout.
void verify_moe_models(const std::string& layouts) {
  struct Model {
    const char* sets;
    const char* precision;
  };
  const int others = static_cast<int>(std::count(layouts.begin(), layouts.end(), ';'));
  for (const Model& m :
       {Model{"--set model.preset=tiny-moe", "fp32"}, Model{"--set model.preset=tiny-moe", "bf16"},
        Model{"--set model.preset=tiny-moe --set model.moe.score=sigmoid --set model.moe.capacity_factor=1.0 "
              "--set model.moe.shared_experts=1 --set model.moe.bias_update_rate=0.001",
              "fp32"},
        Model{"--set model.preset=tiny --set model.moe.experts=4 --set model.moe.top_k=1 --set model.moe.every=2 "
              "--set model.moe.capacity_factor=1.25 --set model.moe.aux_loss_coef=0.01",
              "fp32"}}) {
    SCOPED_TRACE(std::string(m.sets) + " " + m.precision);
    auto r = run_loom("verify " + kTiny + "--steps 6 " + m.sets + " --set precision=" + m.precision +
                      " --set train.batch_size=8 --set train.micro_batch_size=2 --layouts \"" + layouts + "\"");
    EXPECT_EQ(r.rc, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("all layouts agree"));
    EXPECT_EQ(count(r.out, "PASS"), others) << r.out;
  }
}

// Resumes the step-4 checkpoint in `from` with `ranks` ranks and `sets` (which end the run at step 8) and
// expects steps 5-8 of `want`, the uninterrupted single-rank curve, to 1e-5.
void expect_resume_continues(const std::vector<double>& want, const fs::path& from, int ranks, const std::string& sets) {
  auto dir = resume_copy("moe-resume", from, ranks, sets);
  const auto got = losses(dir / "out");
  ASSERT_EQ(got.size(), 4u);
  EXPECT_LT(max_rel_diff(std::vector<double>(want.begin() + 4, want.end()), got), 1e-5);
  fs::remove_all(dir);
}

// Issue 19 items 1 and 4: data, pipeline, ZeRO, recompute and expert-parallel layouts.
TEST(MoeCli, VerifyPassesAcrossDataPipelineZeroAndRecomputeLayouts) {
  verify_moe_models("dp=1;dp=2;dp=2,zero=3;dp=4,zero=2;pp=2;pp=2,dp=2,zero=1;dp=2,recompute=full;recompute=selective;"
                    "dp=2,ep=2;dp=4,ep=4;dp=4,ep=2,recompute=full;pp=2,dp=2,ep=2");
}

// Issue 19 items 2 and 4: tensor parallelism inside the experts (gate and up split by rows, down by
// columns, the router whole; every tp rank routes the whole micro-batch), with and without sequence
// parallelism, composed with ep, ZeRO and pp.
TEST(MoeCli, TensorParallelExpertsReproduceTheSingleRankCurve) {
  verify_moe_models("dp=1;tp=2;tp=2,sp=1;tp=4,sp=1;dp=2,tp=2,ep=2;dp=2,tp=2,sp=1,ep=2,zero=3;pp=2,tp=2,sp=1");
}

// A checkpoint of tensor-parallel experts holds whole experts: it resumes alone and at ep = 2, and
// exports Mixtral's full-width tensors.
TEST(MoeCli, TensorParallelExpertCheckpointsResumeAtOtherLayoutsAndExportWhole) {
  const std::string sets = "--set model.preset=tiny-moe --set model.moe.shared_experts=1 --set train.eval_every=0 "
                           "--set train.micro_batch_size=2";
  auto whole = train_tiny("tpx-whole", 1, sets + " --set train.steps=8");
  auto half = train_tiny("tpx-half", 2, sets + " --set train.steps=4 --set parallel.tp=2 "
                                        "--set parallel.sequence_parallel=true --save-every 4");
  const auto want = losses(whole / "out");
  for (const auto& [ranks, layout] : {std::pair<int, std::string>{1, ""},
                                      {2, " --set parallel.dp=2 --set parallel.ep=2 --set parallel.zero=2"}}) {
    SCOPED_TRACE("tp = 2 checkpoint resumed with" + layout);
    expect_resume_continues(want, half, ranks, sets + " --set train.steps=8" + layout);
  }
  const auto exported = half / "model.safetensors";
  auto r = run_loom("export --checkpoint " + (half / "ck").string() + " --out " + exported.string());
  ASSERT_EQ(r.rc, 0) << r.err;
  SafetensorsFile f(exported.string());
  EXPECT_EQ(f.at("model.layers.1.block_sparse_moe.experts.2.w1.weight").shape, (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(f.at("model.layers.1.block_sparse_moe.experts.2.w2.weight").shape, (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(f.at("model.layers.0.block_sparse_moe.shared_experts.down_proj.weight").shape,
            (std::vector<int64_t>{64, 128}));
  fs::remove_all(whole), fs::remove_all(half);
}

// Issue 19 item 2: ZeRO over the non-expert and the expert parameters each in their own group -- the
// experts' state sharded over the ranks holding the same experts (two of them at dp 4 x ep 2, one at
// dp = ep), the rest over every replica -- reproduces the single-rank curve at every stage, with pp too.
TEST(MoeCli, ZeroShardsTheExpertsOverTheirReplicasAndTheRestOverEveryReplica) {
  verify_moe_models("dp=1;dp=2,ep=2,zero=1;dp=2,ep=2,zero=3;dp=4,ep=2,zero=1;dp=4,ep=2,zero=2;dp=4,ep=2,zero=3;"
                    "pp=2,dp=2,ep=2,zero=1");
}

// Issue 19 item 3: per block per step, tokens per expert (summing to tokens x top_k), dropped pairs,
// max/mean and the aux loss in metrics.jsonl; counters in the trace.
TEST(MoeCli, EachBlocksLoadReachesTheMetricsAndTheTrace) {
  auto dir = scratch_dir("moe-load");
  auto r = run_loom("run -n 2 -- loom train " + kTiny + "--quiet --set model.preset=tiny-moe --set train.steps=3 "
                    "--set parallel.dp=2 --set model.moe.capacity_factor=0.5 --set checkpoint.save_every=0 "
                    "--set train.out_dir=" + (dir / "out").string() + " --trace " + (dir / "trace.json").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  std::ifstream f(dir / "out" / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(f, line); ++lines) {
    const auto j = nlohmann::json::parse(line);
    ASSERT_TRUE(j.contains("moe")) << line;
    ASSERT_EQ(j["moe"].size(), 2u);  // tiny-moe: both blocks
    for (const auto& b : j["moe"]) {
      int64_t pairs = 0, busiest = 0;
      for (int64_t n : b["tokens_per_expert"].get<std::vector<int64_t>>()) pairs += n, busiest = std::max(busiest, n);
      EXPECT_EQ(pairs, 8 * 64 * 2) << "batch 8 x 64 tokens x top-2, over both dp ranks";
      EXPECT_NEAR(b["imbalance"].get<double>(), busiest / (pairs / 4.0), 1e-12);
      // Capacity 0.5: of a rank's micro-batch (4 x 64 tokens, 512 pairs) each expert takes at most
      // ceil(0.5 x 512 / 4) = 64 pairs, so at least half of them are dropped.
      EXPECT_GE(b["dropped"].get<int64_t>(), pairs / 2);
      EXPECT_GT(b["dropped"].get<int64_t>(), 0);
      EXPECT_GT(b["aux_loss"].get<double>(), 0.5);
    }
  }
  EXPECT_EQ(lines, 3);
  std::ifstream t(dir / "trace.json");
  const auto trace = nlohmann::json::parse(t);
  int counters = 0;
  for (const auto& e : trace["traceEvents"])
    if (e.value("ph", "") == "C" && e.value("name", "") == "moe tokens per expert (block 1)") {
      ++counters;
      EXPECT_EQ(e["args"].size(), 4u);
    }
  EXPECT_EQ(counters, 2 * 3) << "one sample per step on each of the 2 ranks";
  fs::remove_all(dir);
}

// Issue 19 items 1 and 4: the selection bias moves (toward balance), is saved like a weight, and a run
// resumed from step 3 -- alone or at dp = 2 under ZeRO-3 -- continues the uninterrupted curve.
TEST(MoeCli, TheSelectionBiasMovesAndResumesWithTheCheckpoint) {
  const std::string sets = "--set model.preset=tiny-moe --set model.moe.score=sigmoid --set model.moe.bias_update_rate=0.01 "
                           "--set train.eval_every=0 --set train.micro_batch_size=4";
  // (micro-batches of 4 on every layout: the aux loss is a function of the micro-batch)
  auto whole = train_tiny("moe-r-whole", 1, sets + " --set train.steps=8");
  auto half = train_tiny("moe-r-half", 1, sets + " --set train.steps=3 --save-every 3");
  const auto want = losses(whole / "out");
  for (int dp : {1, 2}) {
    SCOPED_TRACE("resumed at dp=" + std::to_string(dp));
    auto dir = resume_copy("moe-r", half, dp, sets + " --set train.steps=8 --set parallel.dp=" + std::to_string(dp) +
                                                  " --set parallel.zero=" + (dp > 1 ? "3" : "0"));
    const auto got = losses(dir / "out");
    ASSERT_EQ(got.size(), 5u);
    const auto tail = std::vector<double>(want.begin() + 3, want.end());
    if (dp == 1)
      EXPECT_EQ(got, tail) << "the same layout resumes bitwise";
    else
      EXPECT_LT(max_rel_diff(tail, got), 1e-5);
    fs::remove_all(dir);
  }
  // The bias is exported under DeepSeek-V3's name. Each step moves each expert's by +-0.01 (0 only when
  // exactly at the mean load), so after 3 steps it is a whole number of moves, at most 3, and not all
  // of them cancel.
  const auto exported = half / "model.safetensors";
  auto r = run_loom("export --checkpoint " + (half / "ck").string() + " --out " + exported.string());
  ASSERT_EQ(r.rc, 0) << r.err;
  SafetensorsFile f(exported.string());
  const auto& bias = f.at("model.layers.1.block_sparse_moe.gate.e_score_correction_bias");
  ASSERT_EQ(bias.shape, (std::vector<int64_t>{4}));
  double sum = 0;
  for (int e = 0; e < 4; ++e) {
    const float b = static_cast<const float*>(bias.data)[e];
    EXPECT_NEAR(std::abs(b) * 100, std::round(std::abs(b) * 100), 1e-4) << "a whole number of 0.01 moves";
    EXPECT_LE(std::abs(b), 0.03 + 1e-6);
    sum += std::abs(b);
  }
  EXPECT_GT(sum, 0.0);
  fs::remove_all(whole), fs::remove_all(half);
}

// Issue 19 item 4: Mixtral's tensor names out, and the same weights back in; generation from the
// checkpoint runs the experts.
TEST(MoeCli, ExportsMixtralNamesImportsThemBackAndGenerates) {
  auto dir = train_tiny("moe-hf", 1, "--set model.preset=tiny-moe --set train.steps=2 --save-every 2");
  const auto exported = dir / "model.safetensors";
  auto r = run_loom("export --checkpoint " + (dir / "ck").string() + " --out " + exported.string());
  ASSERT_EQ(r.rc, 0) << r.err;
  {
    SafetensorsFile f(exported.string());
    EXPECT_EQ(f.at("model.layers.0.block_sparse_moe.gate.weight").shape, (std::vector<int64_t>{4, 64}));
    EXPECT_EQ(f.at("model.layers.1.block_sparse_moe.experts.3.w1.weight").shape, (std::vector<int64_t>{128, 64}));
    EXPECT_EQ(f.at("model.layers.1.block_sparse_moe.experts.3.w3.weight").shape, (std::vector<int64_t>{128, 64}));
    EXPECT_EQ(f.at("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape, (std::vector<int64_t>{64, 128}));
    EXPECT_FALSE(f.contains("model.layers.0.mlp.gate_proj.weight"));
  }
  r = run_loom("import --in " + exported.string() + " --out " + (dir / "imported").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto again = dir / "again.safetensors";
  r = run_loom("export --checkpoint " + (dir / "imported").string() + " --out " + again.string());
  ASSERT_EQ(r.rc, 0) << r.err;
  SafetensorsFile a(exported.string()), b(again.string());
  for (const auto& e : a.tensors()) {
    const auto& g = b.at(e.name);
    ASSERT_EQ(g.nbytes, e.nbytes) << e.name;
    EXPECT_EQ(std::memcmp(g.data, e.data, e.nbytes), 0) << e.name;
  }
  r = run_loom("generate --checkpoint " + (dir / "ck").string() + " --prompt-ids \"1 2 3\" --max-tokens 6 --temperature 0");
  EXPECT_EQ(r.rc, 0) << r.err;
  std::istringstream in(r.out);
  int id, n = 0;
  while (in >> id) ++n;
  EXPECT_EQ(n, 6);
  fs::remove_all(dir);
}

// Issue 19 item 4: a checkpoint saved at dp 4 x ep 2 (each expert written by the first ep group, or
// under ZeRO-3 by the rank owning each piece) resumes alone and at other ep and ZeRO, continuing the
// single-rank curve.
TEST(MoeCli, ExpertParallelRunsSplitTheExpertsAndResumeAtAnyEp) {
  const std::string sets = "--set model.preset=tiny-moe --set train.eval_every=0 --set train.micro_batch_size=2";
  auto whole = train_tiny("ep-whole", 1, sets + " --set train.steps=8");
  auto half = train_tiny("ep-half", 4, sets + " --set train.steps=4 --set parallel.dp=4 --set parallel.ep=2 --save-every 4");
  const auto want = losses(whole / "out");
  for (int ep : {1, 4}) {
    SCOPED_TRACE("resumed at ep=" + std::to_string(ep));
    expect_resume_continues(want, half, ep, sets + " --set train.steps=8 --set parallel.dp=" + std::to_string(ep) +
                                                " --set parallel.ep=" + std::to_string(ep));
  }
  auto r = run_loom("ckpt inspect " + (half / "ck").string());
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("saved from: dp=4 tp=1 pp=1 zero=0 ep=2"));
  EXPECT_THAT(r.out, HasSubstr("model.layers.1.block_sparse_moe.experts.3.w2.weight"));
  // Under ZeRO-3 each piece of an expert is written by the one rank owning it: the checkpoint resumes
  // alone, and at ZeRO-1 with ep = dp (the experts' state then whole on their rank).
  auto sharded = train_tiny("ep-z3", 4, sets + " --set train.steps=4 --set parallel.dp=4 --set parallel.ep=2 "
                                          "--set parallel.zero=3 --save-every 4");
  r = run_loom("ckpt inspect " + sharded.string() + "/ck");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("saved from: dp=4 tp=1 pp=1 zero=3 ep=2"));
  for (const auto& [ranks, layout] : {std::pair<int, std::string>{1, ""},
                                      {2, " --set parallel.dp=2 --set parallel.ep=2 --set parallel.zero=1"}}) {
    SCOPED_TRACE("ZeRO-3 checkpoint resumed with" + layout);
    expect_resume_continues(want, sharded, ranks, sets + " --set train.steps=8" + layout);
  }
  fs::remove_all(whole), fs::remove_all(half), fs::remove_all(sharded);
}

// Issue 19 items 2 and 3: at ep = 2 a rank holds half the experts, so less parameter memory than ep = 1
// at the same dp; the exchange appears in the trace, and `loom profile report` gives its exposed time
// and names the straggling expert rank.
TEST(MoeCli, EachExpertParallelRankHoldsItsExpertsAndExchangesRows) {
  auto bytes = [](int ep, const fs::path& trace) {
    auto dir = scratch_dir("ep-mem");
    auto r = run_loom("run -n 2 -- loom train " + kTiny + "--quiet --json --set model.preset=tiny-moe --set train.steps=4 "
                      "--set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.dp=2 --set parallel.ep=" +
                      std::to_string(ep) + " --set train.out_dir=" + (dir / "out").string() +
                      (trace.empty() ? std::string() : " --trace " + trace.string()));
    EXPECT_EQ(r.rc, 0) << r.err;
    if (!trace.empty()) {
      auto report = run_loom("profile report " + (dir / "out").string() + " --json");
      EXPECT_EQ(report.rc, 0) << report.err;
      const auto j = nlohmann::json::parse(report.out);
      EXPECT_GT(j["expert_parallel"]["exposed_s"].get<double>(), 0.0);
      const int straggler = j["expert_parallel"]["straggler"]["rank"].get<int>();
      EXPECT_TRUE(straggler == 0 || straggler == 1);
      EXPECT_THAT(j["expert_parallel"]["straggler"]["op"].get<std::string>(), ::testing::StartsWith("ep_"));
      report = run_loom("profile report " + (dir / "out").string());
      EXPECT_THAT(report.out, HasSubstr("the straggling expert rank: " + std::to_string(straggler)));
    }
    fs::remove_all(dir);
    return nlohmann::json::parse(r.out)["peak_bytes_by_category"]["parameters"].get<double>();
  };
  auto dir = scratch_dir("ep-x");
  const double one = bytes(1, {}), two = bytes(2, dir / "t.json");
  // tiny-moe: 2 blocks x 4 experts x 3 x 128 x 64 f32 weights, half of them held at ep = 2.
  EXPECT_DOUBLE_EQ(one - two, 2.0 * 2 * 3 * 128 * 64 * 4);
  std::ifstream f(dir / "t.json");
  const auto trace = nlohmann::json::parse(f);
  std::map<std::string, int> spans;
  for (const auto& e : trace["traceEvents"])
    if (e.contains("name")) ++spans[e["name"].get<std::string>()];
  for (const char* name : {"ep_counts_all_gather", "ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad"})
    EXPECT_GT(spans[name], 0) << name;
  fs::remove_all(dir);
}

// Issue 19 item 5 and the brief: one line naming the key and the fix, before any rank starts work.
TEST(MoeCli, WhatTheBlockCannotRunIsRefusedInOneLine) {
  auto r = run_loom("train " + kTiny + "--set model.preset=tiny-moe --set model.moe.top_k=5");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("model.moe.top_k = 5 must be in [1, model.moe.experts = 4]"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set model.preset=tiny-moe --set model.moe.d_expert=129 "
               "--set parallel.tp=2");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("parallel.tp = 2 does not divide the expert width 129"));
  EXPECT_THAT(r.err, HasSubstr("valid tp: 1, 3"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set model.preset=tiny-moe --set parallel.cp=2");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("parallel.cp = 2 is not supported yet"));
  r = run_loom("train " + kTiny + "--set model.preset=tiny-moe --set precision=fp8");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("precision = \"fp8\" is not supported yet"));
  r = run_loom("train " + kTiny + "--set model.preset=tiny-moe --set model.moe.score=tanh");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("valid: softmax, sigmoid"));
  r = run_loom("train " + kTiny + "--set model.preset=tiny-moe --set model.moe.every=3");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("leaves no block"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set model.preset=tiny-moe --set parallel.pp=2 "
               "--set parallel.pipeline.schedule=zb-h1");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("zb-h1"));
  // Expert parallelism: experts ep does not divide, ep not dividing dp, a dense model.
  r = run_loom("run -n 3 -- loom train " + kTiny + "--set model.preset=tiny-moe --set parallel.dp=3 --set parallel.ep=3");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("parallel.ep = 3 does not divide model.moe.experts = 4"));
  EXPECT_THAT(r.err, HasSubstr("valid ep here: 1"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set model.preset=tiny-moe --set parallel.dp=2 --set parallel.ep=4");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("parallel.ep = 4 must divide parallel.dp = 2"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set parallel.dp=2 --set parallel.ep=2");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("needs a mixture-of-experts model"));
}

}  // namespace
}  // namespace loom::test
