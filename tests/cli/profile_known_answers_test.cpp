// Known answers for `loom profile report`: runs built to be bound by one class each get that verdict.
// Timing-based, so this executable runs alone (RUN_SERIAL in tests/CMakeLists.txt): on a machine shared
// with other jobs, descheduled kernels take arbitrary wall time and the classes blur.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_runner.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// Known answers: runs built to be bound by one class each get that verdict -- a slow data loader (an
// injected 150 ms per micro-batch, far past the step's compute even on a loaded machine: host), a wide
// model on one rank (compute), a narrow one with a large vocabulary (memory), and tiny at dp=4 in fp32
// with one all-reduce after backward and 16-token micro-batches of one sequence on 2 cores
// (collectives). The roofline is given (ctest fixes LOOM_PEAK_FLOPS at 1e12, far above these cores):
// 100 GFLOP/s and 10 GB/s per rank.
TEST(ProfileCli, RunsBuiltToBeBoundByEachClassGetThatVerdict) {
  auto dir = scratch_dir("profile-known");
  const std::string tiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml --quiet --set train.steps=6 "
                           "--set train.eval_every=0 --set checkpoint.save_every=0 ";
  struct Case {
    const char* name;
    std::string command, prefix, verdict, detail;
  };
  const Case cases[] = {
      {"host", "train " + tiny + "--set train.micro_batch_size=8", "LOOM_FAULT_INJECT=slow_data:150",
       "verdict: bound by host overhead", "data_load"},
      {"compute",
       "train " + tiny + "--set model.d_model=512 --set model.d_ff=2048 --set model.n_heads=8 --set model.n_kv_heads=8",
       "", "verdict: bound by compute", "gemm_fwd"},
      // Narrow (d_model 16) with a 16k vocabulary: every GEMM has a side of 16 (at most 8 FLOP per
      // byte, under the 10 of this roofline's ridge) and the loss streams 16k logits a token.
      {"memory",
       "train " + tiny + "--set model.d_model=16 --set model.n_heads=2 --set model.n_kv_heads=2 --set model.d_ff=64 "
                         "--set model.vocab_size=16384",
       "", "verdict: bound by memory", "softmax_xent"},
      {"collectives",
       "run -n 4 -- loom train " + tiny + "--set parallel.dp=4 --set parallel.bucket_kb=0 --set train.batch_size=4 "
                                          "--set train.seq_len=16",
       // The detail names a data-parallel collective: the gradient all-reduce as the largest wait, or,
       // when 4 ranks on 2 cores leave one descheduled, the collective where the others waited for it.
       "", "verdict: bound by collectives", "dp_"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string out = (dir / c.name).string();
    auto r = run_loom(c.command + " --set train.out_dir=" + out + " --set trace.file=" + out + "/trace.json", c.prefix);
    ASSERT_EQ(r.rc, 0) << r.err;
    r = run_loom("profile report " + out + " --bandwidth 1e10 --peak-flops 1e11");
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_THAT(r.out, HasSubstr(c.verdict)) << r.out;
    EXPECT_THAT(r.out, HasSubstr(c.detail)) << r.out;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom::test
