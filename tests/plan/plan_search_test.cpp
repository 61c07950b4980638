// The layout search and the validation against published results: every returned layout divides the
// model and fits memory, bad input is one clear line, and the cost model's error stays within the
// goals of issue 6 (or, where a goal is missed, within the bound docs/planner.md reports).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

#include <cmath>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "../test_support.h"
#include "loom/error.h"
#include "loom/plan/engine_memory.h"
#include "loom/plan/search.h"
#include "loom/plan/validation.h"

using namespace loom;
using namespace loom::plan;

namespace {

const std::vector<std::string> kDirs = {LOOM_SOURCE_DIR "/configs/hardware"};

Job job(const std::string& model, const std::string& cluster, int64_t seq, int64_t batch) {
  Job j;
  j.model = plan_model(model);
  j.cluster = resolve_cluster(cluster, kDirs);
  j.seq = seq, j.global_batch = batch;
  return j;
}

std::string error_of(const std::function<void()>& f) { return loom::test::config_error_of(f); }

}  // namespace

TEST(Search, EveryReturnedLayoutDividesTheModelAndFitsMemory) {
  for (auto [model, cluster, seq, batch] : {std::tuple{"llama3-70b", "trn2:32", 8192, 64},
                                            std::tuple{"gpt3-175b", "h100:64", 2048, 128},
                                            std::tuple{"mixtral-8x7b", "h100:32", 4096, 64}}) {
    Job j = job(model, cluster, seq, batch);
    auto r = search(j, {}, 50);
    ASSERT_FALSE(r.ranked.empty()) << model;
    EXPECT_GT(r.rejected[Reject::Memory], 0) << model;  // some layouts of these big models must not fit
    for (auto& c : r.ranked) {
      const auto& l = c.layout;
      EXPECT_TRUE(check_layout(l, j).ok()) << l.str();
      EXPECT_EQ(l.devices(), j.cluster.devices);
      EXPECT_EQ(j.model.cfg.n_heads % l.tp, 0);
      // The blocks divide over the chunks, or the layout runs the trimmed-ends cut that holds them all.
      const auto cut = pipeline_cut(l, j);
      if (cut.empty())
        EXPECT_EQ(j.model.cfg.n_layers % (l.pp * l.vpp), 0) << l.str();
      else
        EXPECT_EQ(std::accumulate(cut.begin(), cut.end(), int64_t{0}), j.model.cfg.n_layers) << l.str();
      EXPECT_EQ(j.global_batch % (l.dp * l.micro_batch), 0);
      EXPECT_LE(c.memory.total, j.cluster.hw.device.memory_bytes * (1 - j.memory_margin)) << l.str();
      EXPECT_GT(c.time.total, 0);
    }
    for (size_t i = 1; i < r.ranked.size(); ++i) EXPECT_LE(r.ranked[i - 1].time.total, r.ranked[i].time.total);
  }
}

TEST(Search, FixedKnobsAreHonoured) {
  Fixed f;
  apply_fix(f, "tp=8");
  apply_fix(f, "recompute=selective");
  auto r = search(job("gpt3-175b", "a100:64", 2048, 128), f, 20);
  for (auto& c : r.ranked) {
    EXPECT_EQ(c.layout.tp, 8);
    EXPECT_EQ(c.layout.recompute, Recompute::Selective);
  }
  EXPECT_TRUE(r.warnings.empty());
  // A pinned tp the search would not try (across the 8-GPU nodes) is priced as asked, its all-reduces
  // on the inter-node network, and said so.
  Fixed across;
  apply_fix(across, "tp=16");
  auto wide = search(job("gpt3-175b", "a100:64", 2048, 128), across, 5);
  ASSERT_EQ(wide.warnings.size(), 1u);
  EXPECT_NE(wide.warnings[0].find("--fix tp=16 is a layout the search does not try"), std::string::npos);
  EXPECT_NE(wide.warnings[0].find("cross the inter-node network"), std::string::npos);
  for (auto& c : wide.ranked) EXPECT_EQ(c.layout.tp, 16);
}

// A sequence beyond a rotary model's context is a context extension: planned (context parallelism
// splits it) with a warning; a learned position table, or Loom's engine, cannot go past it.
TEST(Search, LongerThanTheContextIsPlannedForRotaryModelsWithContextParallelism) {
  auto r = search(job("llama3-8b", "h100:64", 131072, 64), {}, 5);
  ASSERT_FALSE(r.ranked.empty());
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("beyond llama3-8b's context of 8192 tokens"), std::string::npos) << r.warnings[0];
  for (auto& c : r.ranked) EXPECT_GT(c.layout.cp, 1) << c.layout.str() << ": 128k tokens need the sequence split";
  EXPECT_NE(error_of([&] { search(job("gpt3-175b", "a100:64", 4096, 64), {}, 5); }).find("learned position table"),
            std::string::npos);
  Job engine = job("llama-mini", "a100:8", 512, 8);
  engine.software.loom_engine = true;
  EXPECT_NE(error_of([&] { search(engine, {}, 5); }).find("Loom's engine trains up to it"), std::string::npos);
  // ALiBi (MPT) has no context limit: its planner table follows the sequence, so 64K is planned.
  Job alibi = job("mpt-7b", "h100:8", 65536, 16);
  alibi.model = alibi.model.at_sequence(alibi.seq);
  r = search(alibi, {}, 3);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_TRUE(r.warnings.empty()) << r.warnings[0];
}

TEST(Search, MoreBandwidthOrFlopsNeverSlowsTheChosenLayout) {
  Job j = job("llama3-8b", "h100:8", 8192, 32);
  auto best = search(j, {}, 1).ranked.front();
  for (auto& s : sensitivity(j, {}, best.layout)) {
    if (s.same_layout <= 0) continue;
    if (s.better) {  // x2 of a figure, or x0.5 of the link latency
      EXPECT_LE(s.same_layout, best.time.total * (1 + 1e-9)) << s.figure;
    } else {
      EXPECT_GE(s.same_layout, best.time.total * (1 - 1e-9)) << s.figure;
    }
  }
}

// The what-if names the requirement that pays most: a compute-bound job gains most from FLOP/s.
TEST(Search, SensitivityVerdictNamesTheFigureThatPaysMost) {
  Job j = job("llama3-8b", "h100:8", 8192, 32);
  auto best = search(j, {}, 1).ranked.front();
  ASSERT_EQ(best.time.bound(), "compute");
  const auto v = sensitivity_verdict(sensitivity(j, {}, best.layout), best.time.total);
  EXPECT_EQ(v.pays_most, "peak FLOP/s");
  EXPECT_LT(v.gain, -0.2);
  EXPECT_EQ(v.hurts_most, "peak FLOP/s");
  EXPECT_GT(v.loss, 0.5);
  // Hand-made rows: a halving that leaves nothing that fits hurts most; a doubling that helps nothing
  // pays nothing.
  const std::vector<Sensitivity> rows = {{"memory capacity", 0.5, false, 0, 0}, {"peak FLOP/s", 0.5, false, 12, 12},
                                         {"memory bandwidth", 2, true, 10.5, 10.5}};
  const auto w = sensitivity_verdict(rows, 10);
  EXPECT_EQ(w.hurts_most, "memory capacity");
  EXPECT_TRUE(std::isinf(w.loss));
  EXPECT_TRUE(w.pays_most.empty());
  // Latency improves when it halves: a latency-bound step names it as what pays.
  const std::vector<Sensitivity> lat = {{"link latency", 0.5, true, 6, 6}, {"link latency", 2, false, 18, 18},
                                        {"peak FLOP/s", 2, true, 9, 9}};
  EXPECT_EQ(sensitivity_verdict(lat, 10).pays_most, "link latency");
  EXPECT_EQ(sensitivity_verdict(lat, 10).hurts_most, "link latency");
}

TEST(Search, LayoutThatCannotDivideTheModelIsAOneLineError) {
  Fixed f;
  apply_fix(f, "tp=3");
  std::string e = error_of([&] { search(job("megatron-7.5b", "a100:24", 2048, 48), f, 5); });
  EXPECT_NE(e.find("no layout"), std::string::npos) << e;
  EXPECT_NE(e.find("does not divide the model"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);
}

TEST(Search, ImpossibleBatchAndBadJobsAreOneLineErrors) {
  Fixed f;
  apply_fix(f, "dp=8");
  std::string e = error_of([&] { search(job("mini", "a100:8", 256, 3), f, 5); });
  EXPECT_NE(e.find("batch"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { search(job("mini", "a100:8", 4096, 8), {}, 5); }).find("exceeds"), std::string::npos);
  EXPECT_NE(error_of([&] { search(job("mini", "a100:8", 256, 0), {}, 5); }).find("--global-batch"), std::string::npos);
  EXPECT_NE(error_of([] { Fixed g; apply_fix(g, "warp=2"); }).find("not a layout key"), std::string::npos);
  EXPECT_NE(error_of([] { Fixed g; apply_fix(g, "recompute=some"); }).find("not a recompute policy"), std::string::npos);
  // A model that cannot fit at all (405B on one A100) says why.
  std::string mem = error_of([&] { search(job("llama3-405b", "a100:1", 8192, 8), {}, 5); });
  EXPECT_NE(mem.find("does not fit in memory"), std::string::npos) << mem;
}

TEST(Validation, ErrorsAgainstPublishedResultsStayWithinTheRecordedBounds) {
  auto rep = validate_file(LOOM_SOURCE_DIR "/tests/plan/published_results.toml", kDirs);
  // Issue 6's goals.
  EXPECT_LE(rep.throughput_mean, 0.10);
  EXPECT_LE(rep.throughput_worst, 0.20);
  EXPECT_LE(rep.memory_worst, 0.10);
  EXPECT_LE(rep.speedup_worst, 0.05);
  EXPECT_LE(rep.throughput_mean / rep.constant_mean, 0.5);
  // The shipped GEMM efficiency is the one these rows fit (one number for all rows), and a row left out
  // of that fit is still predicted at under half the constant's left-out error.
  EXPECT_NEAR(rep.gemm_scale_fitted, 1.0, 0.03);
  EXPECT_LE(rep.gemm_loo_mean / rep.constant_loo_mean, 0.5);
  EXPECT_GT(rep.constant_mean, 0.05);  // the bar is a real one
}

TEST(PlanCli, PrintsJsonForAJobAndOneLineErrors) {
  auto run = [](const std::string& args, int& rc) {
    std::string out;
    FILE* p = ::popen((std::string(LOOM_BINARY) + " " + args + " 2>&1").c_str(), "r");
    std::array<char, 4096> buf;
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    rc = WEXITSTATUS(::pclose(p));
    return out;
  };
  int rc = 0;
  std::string out = run("plan --model llama3-8b --cluster " LOOM_SOURCE_DIR "/configs/hardware/h100.toml:16 --seq 8192 "
                        "--global-batch 64 --top 3 --json",
                        rc);
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["layouts"].size(), 3u);
  EXPECT_GT(j["layouts"][0]["tokens_per_s"].get<double>(), 0);
  EXPECT_FALSE(j["layouts"][0].contains("pipeline_layers"));  // only an uneven cut is listed
  // 126 layers on 16 stages: the trimmed-ends cut, in the JSON and in --explain.
  out = run("plan --model llama3-405b --cluster h100:1024 --seq 8192 --global-batch 512 --fix tp=8 pp=16 dp=8 "
            "recompute=full --top 1 --json",
            rc);
  ASSERT_EQ(rc, 0) << out;
  std::vector<int64_t> trimmed{7};
  for (int i = 0; i < 14; ++i) trimmed.push_back(8);
  trimmed.push_back(7);
  EXPECT_EQ(nlohmann::json::parse(out)["layouts"][0]["pipeline_layers"].get<std::vector<int64_t>>(), trimmed);
  out = run("plan --model llama3-405b --cluster h100:1024 --seq 8192 --global-batch 512 --fix tp=8 pp=16 dp=8 "
            "recompute=full --top 1 --explain",
            rc);
  EXPECT_NE(out.find("blocks per pipeline chunk 7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7"), std::string::npos) << out;
  // MPT at 64K tokens (its table follows the sequence) with llm-foundry's Triton attention: planned, the
  // kernel named on the profile line, slower than as FlashAttention-2; an unknown kernel refused.
  const std::string mpt = "plan --model mpt-7b --cluster h100:8 --seq 65536 --global-batch 16 --software pytorch-fsdp "
                          "--fix tp=1 pp=1 dp=8 mb=1 zero=3 recompute=full --top 1 --json";
  out = run(mpt + " --attention-kernel triton", rc);
  ASSERT_EQ(rc, 0) << out;
  j = nlohmann::json::parse(out);
  EXPECT_NE(j["software_assumptions"].get<std::string>().find("flash (triton) attention"), std::string::npos) << out;
  const double triton = j["layouts"][0]["tokens_per_s"].get<double>();
  out = run(mpt, rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_GT(nlohmann::json::parse(out)["layouts"][0]["tokens_per_s"].get<double>(), 1.3 * triton);
  out = run(mpt + " --attention-kernel fa3", rc);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("--attention-kernel \"fa3\" is not a known attention kernel (valid: flash2, triton)"),
            std::string::npos) << out;
  out = run("plan --model nope --cluster a100 --seq 2048 --global-batch 8", rc);
  EXPECT_EQ(rc, 1);
  EXPECT_EQ(out.find("loom: error: unknown model 'nope'"), 0u) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}

// --engine loom: only the layouts Loom's engine runs (dp x ZeRO x tp, with or without SP, x pp under
// gpipe / 1f1b / interleaved with ZeRO 0-1, x cp, x micro-batch, x recompute but not with zb-h1; no ep),
// with its own memory.
TEST(Search, TheLoomEngineProfileSearchesOnlyWhatTheEngineRuns) {
  Job j = job("mini", "h100:4", 256, 64);
  j.software.loom_engine = true, j.software.zero_bubble = true;
  auto r = search(j, {}, 1000);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GT(r.rejected[Reject::Engine], 0);
  bool tensor_parallel = false, pipeline = false, recompute = false, context = false;
  for (auto& c : r.ranked) {
    const auto& l = c.layout;
    EXPECT_EQ(l.ep, 1) << l.str();
    tensor_parallel = tensor_parallel || l.tp > 1;
    pipeline = pipeline || l.pp > 1;
    context = context || l.cp > 1;
    if (l.pp > 1) {
      EXPECT_TRUE(l.schedule != Schedule::ZeroBubble || l.tp == 1) << l.str();
      EXPECT_TRUE(l.zero <= 1 || l.dp * l.cp == 1) << l.str();
    }
    if (l.pp > 1 && l.schedule == Schedule::ZeroBubble) EXPECT_EQ(l.recompute, Recompute::None) << l.str();
    recompute = recompute || l.recompute != Recompute::None;
    EXPECT_DOUBLE_EQ(c.memory.total,
                     loom_engine_memory(j.model.cfg, l, j.seq, true, {micro_batches(l, j), {}}).total()) << l.str();
  }
  EXPECT_TRUE(tensor_parallel) << "tp layouts are the engine's too";
  EXPECT_TRUE(pipeline) << "pp layouts are the engine's too";
  EXPECT_TRUE(recompute) << "recompute is the engine's too";
  EXPECT_TRUE(context) << "cp layouts are the engine's too";
}

// --fix cp_mode=all-to-all prices Ulysses (its own scratch) and keeps only the cp degrees whose heads
// split; the engine's ZeRO shards over dp x cp, so dp = 1 with cp = 2 may shard.
TEST(Search, TheLoomEngineRunsBothContextParallelModes) {
  Job j = job("mini", "h100:2", 256, 4);  // 6 heads: cp 2 splits them, cp 4 does not
  j.software.loom_engine = true;
  Fixed ring, a2a;
  apply_fix(ring, "cp=2"), apply_fix(ring, "dp=1"), apply_fix(ring, "zero=1");
  a2a = ring;
  apply_fix(a2a, "cp_mode=all-to-all");
  const auto r = search(j, ring, 10), u = search(j, a2a, 10);
  ASSERT_FALSE(r.ranked.empty());
  ASSERT_FALSE(u.ranked.empty());
  EXPECT_FALSE(r.ranked[0].layout.cp_all_to_all);
  EXPECT_TRUE(u.ranked[0].layout.cp_all_to_all);
  EXPECT_EQ(r.ranked[0].layout.zero, 1);
  EXPECT_NE(r.ranked[0].memory.activations, u.ranked[0].memory.activations);
  // Ulysses' all-to-alls are waited for; the ring's hops hide under attention at this length.
  EXPECT_GT(u.ranked[0].time.cp, r.ranked[0].time.cp);
  Job four = job("mini", "h100:4", 256, 4);
  four.software.loom_engine = true;
  Fixed cp4;
  apply_fix(cp4, "cp=4"), apply_fix(cp4, "cp_mode=all-to-all");
  try {
    search(four, cp4, 10);
    ADD_FAILURE() << "cp = 4 all-to-all cannot split 6 heads";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("cp = 4 all-to-all needs 6 query and 6 KV heads per tp rank"));
  }
  EXPECT_THROW(apply_fix(cp4, "cp_mode=zigzag"), ConfigError);
  // The published stacks' profiles price the ring alone.
  Job megatron = job("mini", "h100:2", 256, 4);
  try {
    search(megatron, a2a, 10);
    ADD_FAILURE() << "the megatron profile has no all-to-all cp";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("cp_mode=all-to-all is priced for Loom's engine"));
  }
}
