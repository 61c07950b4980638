// Precision modes end to end (issue 16 item 1): bf16-sr trains, says so, and -- its stochastic
// rounding keyed by (seed, update step, parameter, global element) -- reproduces the one-rank curve under
// data parallelism, every ZeRO stage, tensor parallelism with and without SP and a pipeline, GPT-2 and Llama (fewer
// KV heads than tp), far inside bf16's tolerance; an unknown precision is refused naming the valid ones.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "run_metrics.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;

const std::string kTiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml ";

TEST(PrecisionCli, StochasticRoundingIsTheSameUnderEveryLayout) {
  for (const char* model : {"--set model.preset=tiny", "--set model.preset=tiny-llama --set model.n_kv_heads=1"}) {
    SCOPED_TRACE(model);
    auto r =
        run_loom("verify " + kTiny + "--steps 8 " + std::string(model) +
                 " --set precision=bf16-sr --set train.batch_size=8 --set train.micro_batch_size=2 --tolerance 1e-4 "
                 "--layouts \"dp=1;dp=2;dp=2,zero=1;dp=2,zero=3;tp=2;tp=2,sp=1;dp=2,tp=2,zero=1;pp=2\"");
    EXPECT_EQ(r.rc, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr(" bf16-sr, tolerance 0.0001"));
    EXPECT_THAT(r.out, HasSubstr("all layouts agree"));
    EXPECT_EQ(count(r.out, "PASS"), 7) << r.out;
  }
}

TEST(PrecisionCli, Bf16SrTrainsBesideBf16AndSaysWhichItRan) {
  auto dir = scratch_dir("precision");
  auto run = [&](const std::string& precision) {
    auto r = run_loom("train " + kTiny +
                      "--quiet --json --set train.steps=12 --set train.eval_every=0 "
                      "--set checkpoint.save_every=0 --set precision=" +
                      precision + " --set train.out_dir=" + (dir / precision).string());
    EXPECT_EQ(r.rc, 0) << r.err;
    return nlohmann::json::parse(r.out);
  };
  const auto plain = run("bf16"), sr = run("bf16-sr");
  EXPECT_EQ(sr["precision"], "bf16-sr");
  EXPECT_EQ(plain["precision"], "bf16");
  const double a = plain["final_loss"].get<double>(), b = sr["final_loss"].get<double>();
  EXPECT_NE(a, b) << "the copies are rounded differently";
  EXPECT_NEAR(a, b, 1e-2 * a);
  std::filesystem::remove_all(dir);
}

// Issue 16 item 5: `loom verify --numerics` trains the config once per precision on the same data and
// compares each curve with the first, with a bar on the final validation loss, and plots them (SVG).
TEST(PrecisionCli, VerifyNumericsComparesPrecisionsAndPlotsTheCurves) {
  auto dir = scratch_dir("numerics");
  const std::string svg = (dir / "curves.svg").string();
  auto r = run_loom("verify --numerics " + kTiny + "--steps 6 --set train.eval_every=3 --plot " + svg);
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("3 precisions x 6 steps, tiny on 1 rank(s)"));
  for (const char* p : {"fp32 ", "bf16 ", "bf16-sr "}) EXPECT_THAT(r.out, HasSubstr(p));
  EXPECT_EQ(count(r.out, "PASS"), 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("every precision within the bar"));
  std::ifstream f(svg);
  const std::string page((std::istreambuf_iterator<char>(f)), {});
  EXPECT_EQ(count(page, "<polyline"), 3) << "one curve per precision";
  EXPECT_EQ(count(page, "<circle"), 6) << "validation at steps 3 and 6, per precision";
  EXPECT_THAT(page, HasSubstr("bf16-sr"));
  // An impossible bar fails the comparison (and says so); a bad precision fails before any run.
  r = run_loom("verify --numerics " + kTiny + "--steps 3 --precisions \"fp32;bf16\" --tolerance 1e-12");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("FAIL"));
  r = run_loom("verify --numerics " + kTiny + "--precisions \"fp32;fp7\"");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("--precisions: 'fp7': precision = 'fp7' is not supported"));
  std::filesystem::remove_all(dir);
}

TEST(PrecisionCli, AnUnknownPrecisionIsRefusedNamingTheValidOnes) {
  auto r = run_loom("train " + kTiny + "--set precision=bf16-pure");
  EXPECT_NE(r.rc, 0);
  EXPECT_THAT(r.err, HasSubstr("precision = 'bf16-pure' is not supported (valid: \"fp32\", \"bf16\", \"bf16-sr\")"));
}

}  // namespace
}  // namespace loom::test
