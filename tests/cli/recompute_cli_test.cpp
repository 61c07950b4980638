// Activation recompute end to end (`train.recompute`): under every layout the engine runs with it (one
// rank, tensor + sequence parallelism, pipeline schedules, dp x ZeRO-3), a run that recomputes trains
// exactly the run that keeps everything (fp32 losses bitwise equal, step after step), `loom verify`
// takes recompute as a layout key, and what cannot run is refused in one line before any work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "run_metrics.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;

const std::string kTiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml ";

struct Layout {
  const char* what;
  int ranks;
  const char* sets;
};

TEST(RecomputeCli, EveryLayoutTrainsBitwiseTheSameWithAndWithoutRecompute) {
  const Layout layouts[] = {
      {"one rank, GPT-2, fp32", 1, "--set model.preset=tiny --set precision=fp32"},
      {"tp 2 + sp, Llama, fp32", 2,
       "--set model.preset=tiny-llama --set precision=fp32 --set parallel.tp=2 --set parallel.sequence_parallel=true"},
      {"pp 2 1f1b, GPT-2, fp32", 2, "--set model.preset=tiny --set precision=fp32 --set parallel.pp=2"},
      {"pp 2 interleaved, Llama, bf16", 2,
       "--set model.preset=tiny-llama --set precision=bf16 --set parallel.pp=2 "
       "--set parallel.pipeline.schedule=interleaved-1f1b --set parallel.pipeline.virtual_stages=2"},
      {"dp 2 ZeRO-3, Llama, bf16", 2,
       "--set model.preset=tiny-llama --set precision=bf16 --set parallel.dp=2 --set parallel.zero=3"},
  };
  for (const Layout& l : layouts) {
    std::vector<double> reference;
    for (const char* rc : {"none", "selective", "full"}) {
      SCOPED_TRACE(std::string(l.what) + ", recompute " + rc);
      auto dir = scratch_dir("recompute");
      auto r = run_loom("run -n " + std::to_string(l.ranks) + " -- loom train " + kTiny + "--quiet --json " + l.sets +
                        " --set model.n_layers=4 --set train.steps=4 --set train.batch_size=8"
                        " --set train.micro_batch_size=2 --set train.seq_len=32 --set train.eval_every=0"
                        " --set checkpoint.save_every=0 --set trace.summary=false --set train.recompute=" +
                        rc + " --set train.out_dir=" + (dir / "out").string() +
                        " --set checkpoint.dir=" + (dir / "ckpt").string());
      ASSERT_EQ(r.rc, 0) << r.err;
      EXPECT_EQ(nlohmann::json::parse(r.out)["recompute"], rc);
      const auto curve = losses(dir / "out");
      ASSERT_EQ(curve.size(), 4u);
      if (reference.empty())
        reference = curve;
      else
        EXPECT_EQ(curve, reference) << "recompute changed the computation";
    }
  }
}

TEST(RecomputeCli, VerifyTakesRecomputeAsALayoutKey) {
  auto r = run_loom("verify " + kTiny + "--steps 3 --set model.n_layers=4 --set train.batch_size=8 "
                    "--set train.micro_batch_size=2 --layouts \"dp=1;recompute=full;tp=2,sp=1,recompute=selective;"
                    "pp=2,recompute=full\"");
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "PASS"), 3) << r.out;
}

TEST(RecomputeCli, WhatCannotRunIsRefusedInOneLineBeforeAnyWork) {
  auto dir = scratch_dir("recompute-bad");
  const std::string out = " --set train.out_dir=" + (dir / "out").string();
  auto r = run_loom("train " + kTiny + "--set train.recompute=some" + out);
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("train.recompute = \"some\" is not a recompute policy (\"none\", \"selective\" or \"full\")"));
  r = run_loom("run -n 2 -- loom train " + kTiny + "--set parallel.pp=2 --set parallel.pipeline.schedule=zb-h1 "
               "--set model.n_layers=4 --set train.recompute=full" + out);
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("\"zb-h1\" with train.recompute = \"full\" is not supported"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out" / "metrics.jsonl"));
}

}  // namespace
}  // namespace loom::test
