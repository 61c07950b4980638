// Pipeline parallelism end to end: `loom run -n N -- loom train --set parallel.pp=N` under each schedule
// that runs must reproduce the single-rank loss curve (same seed and data), compose with dp, keep whole
// Hugging Face tensors in checkpoints that resume at another pp, and refuse what it cannot run before any
// work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "loom/core/safetensors.h"
#include "checkpoint_tensors.h"
#include "run_metrics.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

const std::string kTiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml ";

// 4 blocks, 4 micro-batches of 2 per step: pp 2 and 4, every schedule that runs, uneven stages, tied
// (GPT-2) and untied (Llama) embeddings, with dp, fp32 and bf16.
TEST(PipelineCli, VerifyPassesForEveryScheduleOnGpt2AndLlamaInBothPrecisions) {
  for (const char* model :
       {"--set model.preset=tiny", "--set model.preset=tiny-llama --set model.tie_embeddings=false"})
    for (const char* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(model) + " " + precision);
      auto r = run_loom("verify " + kTiny + "--steps 5 " + model + " --set precision=" + precision +
                        " --set model.n_layers=4 --set train.batch_size=8 --set train.micro_batch_size=2 "
                        "--layouts \"dp=1;pp=2;pp=2,schedule=gpipe;pp=2,v=2,schedule=interleaved-1f1b;pp=4;"
                        "pp=2,dp=2;pp=2,schedule=zb-h1;pp=4,schedule=zb-h1\"");
      EXPECT_EQ(r.rc, 0) << r.out << r.err;
      EXPECT_THAT(r.out, HasSubstr("all layouts agree"));
      EXPECT_EQ(count(r.out, "PASS"), 7) << r.out;
    }
  // pp = 4 under gpipe and interleaved (8 chunks of 8 blocks), GPT-2 in fp32 and Llama in bf16.
  for (const char* model :
       {"--set model.preset=tiny --set precision=fp32", "--set model.preset=tiny-llama --set precision=bf16"}) {
    SCOPED_TRACE(model);
    auto r = run_loom(
        "verify " + kTiny + "--steps 3 " + model +
        " --set model.n_layers=8 --set train.batch_size=8 "
        "--set train.micro_batch_size=2 --layouts \"dp=1;pp=4,schedule=gpipe;pp=4,v=2,schedule=interleaved-1f1b\"");
    EXPECT_EQ(r.rc, 0) << r.out << r.err;
    EXPECT_EQ(count(r.out, "PASS"), 2) << r.out;
  }
  // An explicit uneven cut (one block on the first stage, three on the second) is a layout key; set for
  // every layout it would reach the reference, which has no pipeline, and is refused.
  auto r = run_loom("verify " + kTiny +
                    "--steps 4 --set model.n_layers=4 --set train.batch_size=8 "
                    "--set train.micro_batch_size=2 --layouts \"dp=1;pp=2,layers=1/3;pp=2,layers=3/1\"");
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "PASS"), 2) << r.out;
  r = run_loom("verify " + kTiny +
               "--steps 4 --set model.n_layers=4 --set train.batch_size=8 "
               "--set train.micro_batch_size=2 --layouts \"dp=1;pp=2\" --set parallel.pipeline.layers=1,3");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("parallel.pipeline.layers = \"1,3\" cuts a pipeline, which needs parallel.pp > 1"));
}

TEST(PipelineCli, UnevenStagesTrainLikeOneRank) {
  auto one = scratch_dir("pp-uneven-1"), two = scratch_dir("pp-uneven-2");
  const std::string common = kTiny +
                             "--quiet --set model.n_layers=4 --set train.batch_size=8 --set train.micro_batch_size=2 "
                             "--set train.steps=4 --set checkpoint.save_every=0 --set train.eval_every=0";
  ASSERT_EQ(run_loom("train " + common + " --set train.out_dir=" + (one / "out").string()).rc, 0);
  auto r = run_loom("run -n 2 -- loom train " + common +
                    " --set parallel.pp=2 --set parallel.pipeline.layers=1,3 "
                    "--set train.out_dir=" +
                    (two / "out").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_LT(max_rel_diff(losses(one / "out"), losses(two / "out")), 1e-5);
  fs::remove_all(one), fs::remove_all(two);
}

// Saved at pp=2, resumed at pp=1, 2 and 4: each continues the uninterrupted curve; the checkpoint holds
// whole tensors and exports.
TEST(PipelineCli, ACheckpointSavedAtPp2ResumesAtAnyPp) {
  const std::string common = kTiny +
                             "--quiet --set model.n_layers=4 --set train.batch_size=8 "
                             "--set train.micro_batch_size=2 --set train.eval_every=0";
  auto whole = scratch_dir("pp-ck-whole"), half = scratch_dir("pp-ck-half");
  ASSERT_EQ(run_loom("train " + common + " --set train.steps=6 --set checkpoint.save_every=0 --set train.out_dir=" +
                     (whole / "out").string() + " --save-dir " + (whole / "ck").string())
                .rc,
            0);
  auto r = run_loom("run -n 2 -- loom train " + common +
                    " --set parallel.pp=2 --set train.steps=3 --save-every 3 "
                    "--set train.out_dir=" +
                    (half / "out").string() + " --save-dir " + (half / "ck").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto want = losses(whole / "out");
  for (int pp : {1, 2, 4}) {
    SCOPED_TRACE("resumed at pp=" + std::to_string(pp));
    auto dir = scratch_dir("pp-ck-r" + std::to_string(pp));
    fs::copy(half / "ck", dir / "ck", fs::copy_options::recursive);
    r = run_loom("run -n " + std::to_string(pp) + " -- loom train " + common +
                 " --set train.steps=6 --set parallel.pp=" + std::to_string(pp) + " --set train.out_dir=" +
                 (dir / "out").string() + " --save-dir " + (dir / "ck").string() + " --resume");
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_LT(max_rel_diff(std::vector<double>(want.begin() + 3, want.end()), losses(dir / "out")), 1e-5);
    fs::remove_all(dir);
  }
  EXPECT_EQ(checkpoint_tensors(half / "ck" / "step-00000003").size(), 4u * 12 + 4)
      << "every block's tensors and the embeddings and final norm";
  fs::remove_all(whole), fs::remove_all(half);
}

TEST(PipelineCli, WhatCannotRunIsRefusedBeforeAnyWork) {
  auto r = run_loom("run -n 4 -- loom train " + kTiny +
                    "--set parallel.pp=2 --set parallel.tp=2 "
                    "--set parallel.pipeline.schedule=zb-h1");
  EXPECT_THAT(r.err, HasSubstr("\"zb-h1\" with parallel.tp = 2 is not supported yet: the tensor-parallel ops do not "
                               "split their backward"));
  r = run_loom("run -n 2 -- loom train " + kTiny +
               "--set parallel.pp=2 --set parallel.pipeline.virtual_stages=2 "
               "--set train.micro_batch_size=2 --set parallel.pipeline.schedule=interleaved-1f1b");
  EXPECT_THAT(r.err, HasSubstr("model.n_layers = 2 cannot give pp x virtual_stages = 2 x 2 = 4 chunks a block each"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set parallel.pp=2 --set parallel.pipeline.layers=1,2");
  EXPECT_THAT(r.err, HasSubstr("parallel.pipeline.layers sums to 3 blocks, but model.n_layers = 2"));
  // verify's one-count cut reads as a cut (a list of one), not as a TOML integer of the wrong type.
  r = run_loom("verify " + kTiny + "--steps 2 --layouts \"dp=1;pp=2,layers=2\"");
  EXPECT_THAT(r.err, HasSubstr("parallel.pipeline.layers lists 1 block counts, but pp x virtual_stages = 2 chunks"));
  r = run_loom("run -n 2 -- loom train " + kTiny +
               "--set parallel.pp=2 --set model.n_layers=4 --set train.batch_size=6 "
               "--set train.micro_batch_size=2 --set parallel.pipeline.virtual_stages=2 "
               "--set parallel.pipeline.schedule=interleaved-1f1b");
  EXPECT_THAT(r.err, HasSubstr("3 micro-batches per step is not a multiple; use 4 or 2"));
  r = run_loom("run -n 4 -- loom train " + kTiny + "--set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=2");
  EXPECT_THAT(r.err, HasSubstr("parallel.pp = 2 with parallel.zero = 2 is not supported: ZeRO-2/3 reduce and free each "
                               "block's gradients during every micro-batch's backward"));
  EXPECT_THAT(r.err, HasSubstr("use parallel.zero = 1"));
}

// pp x tp (with and without SP), pp x dp under ZeRO-1, and all three axes at once (8 ranks: kept short).
TEST(PipelineCli, VerifyPassesComposedWithTensorParallelismAndZero1) {
  for (const char* model : {"--set model.preset=tiny", "--set model.preset=tiny-llama"})
    for (const char* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(model) + " " + precision);
      auto r = run_loom("verify " + kTiny + "--steps 4 " + model + " --set precision=" + precision +
                        " --set model.n_layers=4 --set train.batch_size=8 --set train.micro_batch_size=2 "
                        "--layouts \"dp=1;pp=2,tp=2;pp=2,tp=2,sp=1;pp=2,dp=2,zero=1\"");
      EXPECT_EQ(r.rc, 0) << r.out << r.err;
      EXPECT_EQ(count(r.out, "PASS"), 3) << r.out;
    }
  for (const char* model :
       {"--set model.preset=tiny --set precision=bf16", "--set model.preset=tiny-llama --set precision=fp32"}) {
    SCOPED_TRACE(model);
    auto r = run_loom("verify " + kTiny + "--steps 3 " + model +
                      " --set model.n_layers=4 --set train.batch_size=8 "
                      "--set train.micro_batch_size=2 --layouts \"dp=1;pp=2,dp=2,tp=2,zero=1\"");
    EXPECT_EQ(r.rc, 0) << r.out << r.err;
    EXPECT_EQ(count(r.out, "PASS"), 1) << r.out;
  }
}

// A pp=2 x tp=2 checkpoint holds whole tensors (each stage's tp shards gathered, then the stages), and
// so does pp=2 x dp=2 under ZeRO-1 in bf16 (sharded moments and masters gathered first): each resumes
// on one rank, continuing the uninterrupted curve.
TEST(PipelineCli, APipelineTimesTensorParallelCheckpointResumesOnOneRank) {
  for (const char* layout : {"--set parallel.tp=2 --set precision=fp32",
                             "--set parallel.dp=2 --set parallel.zero=1 --set parallel.pipeline.bf16_transfers=false "
                             "--set precision=bf16"}) {
    SCOPED_TRACE(layout);
    const std::string precision = std::string(layout).substr(std::string(layout).find("precision"));
    const std::string common = kTiny +
                               "--quiet --set model.n_layers=4 --set train.batch_size=8 "
                               "--set train.micro_batch_size=2 --set train.eval_every=0 --set " +
                               precision;
    auto whole = scratch_dir("pptp-ck-whole"), split = scratch_dir("pptp-ck-split");
    ASSERT_EQ(run_loom("train " + common + " --set train.steps=4 --set checkpoint.save_every=0 --set train.out_dir=" +
                       (whole / "out").string())
                  .rc,
              0);
    auto r = run_loom("run -n 4 -- loom train " + common + " --set parallel.pp=2 " + layout +
                      " --set train.steps=2 "
                      "--save-every 2 --set train.out_dir=" +
                      (split / "out").string() + " --save-dir " + (split / "ck").string());
    ASSERT_EQ(r.rc, 0) << r.err;
    r = run_loom("train " + common + " --set train.steps=4 --set train.out_dir=" + (split / "out1").string() +
                 " --save-dir " + (split / "ck").string() + " --resume");
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto want = losses(whole / "out");
    EXPECT_LT(max_rel_diff(std::vector<double>(want.begin() + 2, want.end()), losses(split / "out1")), 1e-5);
    fs::remove_all(whole), fs::remove_all(split);
  }
}

// In bf16 runs activations and their gradients cross stages in bf16: half the bytes of each transfer, the
// residual stream rounded at the stage boundary (the curve moves, within bf16's tolerance); f32
// transfers reproduce one rank's curve.
TEST(PipelineCli, Bf16RunsSendBf16AcrossStagesUnlessAskedForF32) {
  const std::string common = kTiny +
                             "--quiet --json --set precision=bf16 --set model.n_layers=4 --set train.batch_size=8 "
                             "--set train.micro_batch_size=2 --set train.steps=4 --set train.eval_every=0 "
                             "--set checkpoint.save_every=0 --set trace.summary=true";
  auto one = scratch_dir("pp-wire-1"), f32 = scratch_dir("pp-wire-f32"), bf = scratch_dir("pp-wire-bf16");
  ASSERT_EQ(run_loom("train " + common + " --set train.out_dir=" + (one / "out").string()).rc, 0);
  auto r32 = run_loom("run -n 2 -- loom train " + common +
                      " --set parallel.pp=2 --set parallel.pipeline.bf16_transfers=false "
                      "--set train.out_dir=" +
                      (f32 / "out").string());
  ASSERT_EQ(r32.rc, 0) << r32.err;
  auto r16 = run_loom("run -n 2 -- loom train " + common +
                      " --set parallel.pp=2 --set train.out_dir=" + (bf / "out").string());
  ASSERT_EQ(r16.rc, 0) << r16.err;
  // (Not bitwise: one rank runs 2 threads, each stage 1. Where the CPU has no bf16 instructions the bf16
  // GEMMs are f32 GEMMs of bf16-rounded inputs, whose sums split by thread count round a few activations
  // to the other bf16 neighbour: 4.6e-6 on an AVX2-only EPYC, under 1e-6 with AVX512-BF16.)
  const double f32_wire = max_rel_diff(losses(one / "out"), losses(f32 / "out"));
  EXPECT_LT(f32_wire, 2e-5);
  const double moved = max_rel_diff(losses(one / "out"), losses(bf / "out"));
  EXPECT_GT(moved, 0.0);
  EXPECT_LT(moved, 1e-2);
  // The bf16 wire adds its two buffers (one send, one receive of a micro-batch's 2 x 64 rows of 64 bf16).
  const auto a16 = nlohmann::json::parse(r16.out)["peak_bytes_by_category"]["activations"].get<double>();
  const auto a32 = nlohmann::json::parse(r32.out)["peak_bytes_by_category"]["activations"].get<double>();
  EXPECT_EQ(a16 - a32, 2.0 * 2 * 2 * 64 * 64);
  fs::remove_all(one), fs::remove_all(f32), fs::remove_all(bf);
}

// Transfers larger than a shared-memory channel takes without its receiver (1 MiB; here 1024 rows x 512
// x 4 B = 2 MiB): GPipe, 1F1B and zb-h1 run; interleaved stages could wait on each other forever, so it is
// refused before any step, naming the sizes and what to use instead.
TEST(PipelineCli, TransfersLargerThanAChannelRunOrAreRefused) {
  const std::string big =
      kTiny +
      "--quiet --set model.d_model=512 --set model.d_ff=512 --set model.n_layers=4 "
      "--set train.seq_len=64 --set train.batch_size=64 --set train.micro_batch_size=16 "
      "--set train.steps=1 --set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.pp=2";
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    SCOPED_TRACE(schedule);
    auto r = run_loom("run -n 2 -- loom train " + big + " --set parallel.pipeline.schedule=" + schedule,
                      "LOOM_COMM_TIMEOUT=60");
    EXPECT_EQ(r.rc, 0) << r.err;
  }
  auto r = run_loom("run -n 2 -- loom train " + big +
                        " --set parallel.pipeline.schedule=interleaved-1f1b "
                        "--set parallel.pipeline.virtual_stages=2",
                    "LOOM_COMM_TIMEOUT=60");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("\"interleaved-1f1b\" sends 2.00 MiB per transfer (1024 rows x 512 wide, f32), more "
                               "than the 1.00 MiB a shm pipeline channel takes without its receiver"));
  EXPECT_THAT(r.err, HasSubstr("Use \"zb-h1\" or \"1f1b\""));
}

// Each stage's idle fraction is measured from its own waits and reported beside the schedule's theory,
// per step in metrics.jsonl and as medians in the summary.
TEST(PipelineCli, TheBubbleIsMeasuredPerStageBesideTheTheory) {
  auto dir = scratch_dir("pp-bubble");
  auto r = run_loom("run -n 2 -- loom train " + kTiny +
                    "--json --set model.n_layers=4 --set train.batch_size=8 "
                    "--set train.micro_batch_size=2 --set train.steps=4 --set train.eval_every=0 "
                    "--set checkpoint.save_every=0 --set parallel.pp=2 --set train.out_dir=" +
                    (dir / "out").string());
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("pipeline idle per step (median"));
  EXPECT_THAT(r.err, HasSubstr("1f1b theory 20.0%"));  // (p - 1) / (m + p - 1) = 1 / 5
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["pipeline"]["idle_by_stage"].size(), 2u);
  EXPECT_NEAR(j["pipeline"]["bubble_theory"].get<double>(), 0.2, 1e-12);
  for (const auto& f : j["pipeline"]["idle_by_stage"]) EXPECT_TRUE(f.get<double>() >= 0 && f.get<double>() < 1) << f;
  std::ifstream log(dir / "out" / "metrics.jsonl");
  std::string line;
  int rows = 0;
  while (std::getline(log, line)) {
    const auto m = nlohmann::json::parse(line);
    ASSERT_TRUE(m.contains("pp_idle")) << line;
    EXPECT_EQ(m["pp_idle"].size(), 2u);
    ++rows;
  }
  EXPECT_EQ(rows, 4);
  fs::remove_all(dir);
}

// A NaN in a pipeline stage's gradient (test-only hook; both stages' dp rank 0) makes both stages skip
// the step: the norm is summed over the pipeline, so they decide alike, and training goes on.
TEST(PipelineCli, ANonFiniteGradientSkipsTheStepOnEveryStage) {
  auto dir = scratch_dir("pp-skip");
  auto r = run_loom("run -n 2 -- loom train " + kTiny +
                        "--json --quiet --set model.n_layers=4 --set train.batch_size=8 "
                        "--set train.micro_batch_size=2 --set train.steps=4 --set train.eval_every=0 "
                        "--set checkpoint.save_every=0 --set parallel.pp=2 --set train.out_dir=" +
                        (dir / "out").string(),
                    "LOOM_FAULT_INJECT=nan_grad:0:2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["skipped_steps"].get<int>(), 1);
  std::ifstream log(dir / "out" / "metrics.jsonl");
  for (std::string line; std::getline(log, line);) {
    const auto m = nlohmann::json::parse(line);
    EXPECT_EQ(m.value("skipped", false), m["step"].get<int>() == 2) << line;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom::test
