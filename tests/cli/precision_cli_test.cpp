// Precision modes end to end (issue 16 item 1): bf16-sr trains, says so, and -- its stochastic
// rounding keyed by (seed, update step, parameter, global element) -- reproduces the one-rank curve under
// data parallelism, every ZeRO stage, tensor parallelism with and without SP and a pipeline, GPT-2 and Llama (fewer
// KV heads than tp), far inside bf16's tolerance; an unknown precision is refused naming the valid ones.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "cli_runner.h"
#include "run_metrics.h"

namespace loom::test {
namespace {

using ::testing::HasSubstr;

const std::string kTiny = "--config " LOOM_SOURCE_DIR "/configs/tiny.toml ";

// `loom verify` of tiny GPT-2 and tiny Llama (one KV head: replicated under tp) in `precision` over
// `layouts`, the first being the reference: every other layout passes at tolerance 1e-4.
void expect_layouts_agree(const std::string& precision, int steps, const std::string& layouts, int others) {
  for (const char* model : {"--set model.preset=tiny", "--set model.preset=tiny-llama --set model.n_kv_heads=1"}) {
    SCOPED_TRACE(model);
    auto r = run_loom("verify " + kTiny + "--steps " + std::to_string(steps) + " " + model + " --set precision=" +
                      precision + " --set train.batch_size=8 --set train.micro_batch_size=2 --tolerance 1e-4 --layouts \"" +
                      layouts + "\"");
    EXPECT_EQ(r.rc, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr(" " + precision + ", tolerance 0.0001"));
    EXPECT_THAT(r.out, HasSubstr("all layouts agree"));
    EXPECT_EQ(count(r.out, "PASS"), others) << r.out;
  }
}

// `loom ARGS` fails before training, saying `message`.
void expect_refused(const std::string& args, const std::string& message) {
  auto r = run_loom(args);
  EXPECT_NE(r.rc, 0) << args;
  EXPECT_THAT(r.err, HasSubstr(message)) << args;
}

// `loom train --json` of tiny for 12 steps in `precision`, its output in dir/precision.
nlohmann::json train_json(const std::filesystem::path& dir, const std::string& precision) {
  auto r = run_loom("train " + kTiny +
                    "--quiet --json --set train.steps=12 --set train.eval_every=0 "
                    "--set checkpoint.save_every=0 --set precision=" +
                    precision + " --set train.out_dir=" + (dir / precision).string());
  EXPECT_EQ(r.rc, 0) << r.err;
  return nlohmann::json::parse(r.out);
}

TEST(PrecisionCli, StochasticRoundingIsTheSameUnderEveryLayout) {
  expect_layouts_agree("bf16-sr", 8, "dp=1;dp=2;dp=2,zero=1;dp=2,zero=3;tp=2;tp=2,sp=1;dp=2,tp=2,zero=1;pp=2", 7);
}

TEST(PrecisionCli, Bf16SrTrainsBesideBf16AndSaysWhichItRan) {
  auto dir = scratch_dir("precision");
  const auto plain = train_json(dir, "bf16"), sr = train_json(dir, "bf16-sr");
  EXPECT_EQ(sr["precision"], "bf16-sr");
  EXPECT_EQ(plain["precision"], "bf16");
  const double a = plain["final_loss"].get<double>(), b = sr["final_loss"].get<double>();
  EXPECT_NE(a, b) << "the copies are rounded differently";
  EXPECT_NEAR(a, b, 1e-2 * a);
  std::filesystem::remove_all(dir);
}

// bf16-pure (issue 16 item 1): weights and AdamW moments in bf16 only, every update rounded
// stochastically under the global element's key -- so every layout trains the same model: data
// parallelism, each ZeRO stage (ZeRO-3 gathers bf16 weights), tp with and without SP, dp x tp and a
// pipeline; GPT-2 (biases, learned positions, tied head) and Llama with fewer KV heads than tp.
TEST(PrecisionCli, PureBf16IsTheSameUnderEveryLayout) {
  expect_layouts_agree("bf16-pure", 6, "dp=1;dp=2;dp=2,zero=2;dp=2,zero=3;tp=2,sp=1;dp=2,tp=2,zero=1;pp=2", 6);
}

// Memory per parameter, measured by the allocator on one rank: fp32 16 bytes (weights, gradients, m,
// v), bf16 18 (+ the bf16 copies), bf16-pure 10 (bf16 weights, f32 gradients, bf16 m and v). The loss
// stays beside bf16's, and the whole-tensor checkpoint format (which gathers f32 masters) is refused.
TEST(PrecisionCli, PureBf16HoldsTenBytesPerParameterAndTrainsBesideBf16) {
  auto dir = scratch_dir("pure");
  const auto f32 = train_json(dir, "fp32"), bf16 = train_json(dir, "bf16"), pure = train_json(dir, "bf16-pure");
  const double params = f32["live_bytes_by_category"]["gradients"].get<double>() / 4;  // f32 gradients
  auto state_bytes = [&](const nlohmann::json& j) {
    const auto& c = j["live_bytes_by_category"];
    return (c["parameters"].get<double>() + c["gradients"].get<double>() + c["optimizer"].get<double>()) / params;
  };
  EXPECT_DOUBLE_EQ(state_bytes(f32), 16.0);
  EXPECT_DOUBLE_EQ(state_bytes(bf16), 18.0);
  EXPECT_LE(state_bytes(pure), 10.0);
  EXPECT_EQ(pure["precision"], "bf16-pure");
  const double a = bf16["final_loss"].get<double>(), b = pure["final_loss"].get<double>();
  EXPECT_NEAR(a, b, 2e-2 * a);
  expect_refused("train " + kTiny + "--set precision=bf16-pure --set checkpoint.format=whole --set train.out_dir=" +
                     (dir / "whole").string(),
                 "checkpoint.format = \"whole\" is not available with precision = \"bf16-pure\"");
  std::filesystem::remove_all(dir);
}

// A bf16-pure checkpoint holds the bf16 values widened to f32 (exactly): resuming at the same layout
// continues bitwise, and a dp=2 x ZeRO-3 checkpoint resumes on one rank and under tp=2.
TEST(PrecisionCli, PureBf16ResumesBitwiseAndAcrossLayouts) {
  auto dir = scratch_dir("pure-ck");
  auto train = [&](const std::string& name, int steps, const std::string& extra, int ranks = 1) {
    const std::string args = "train " + kTiny + "--quiet --set precision=bf16-pure --set train.steps=" +
                             std::to_string(steps) + " --set train.eval_every=0 --set train.batch_size=8 "
                             "--set train.micro_batch_size=2 --set checkpoint.save_every=2 --set train.out_dir=" +
                             (dir / name / "out").string() + " --save-dir " + (dir / name / "ck").string() + " " + extra;
    auto r = run_loom(ranks > 1 ? "run -n " + std::to_string(ranks) + " -- loom " + args : args);
    EXPECT_EQ(r.rc, 0) << r.err;
    return losses(dir / name / "out");
  };
  const auto whole = train("whole", 6, "");
  std::filesystem::create_directories(dir / "again");
  std::filesystem::copy(dir / "whole" / "ck", dir / "again" / "ck", std::filesystem::copy_options::recursive);
  std::ofstream(dir / "again" / "ck" / "latest") << "step-00000004\n";
  const auto resumed = train("again", 6, "--resume");
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], whole[4]);  // bitwise
  EXPECT_EQ(resumed[1], whole[5]);

  const auto sharded = train("zero3", 6, "--set parallel.dp=2 --set parallel.zero=3", 2);
  ASSERT_EQ(sharded.size(), 6u);
  EXPECT_LT(max_rel_diff(sharded, whole), 1e-4);
  for (const auto& [name, layout, ranks] : {std::tuple{"one", "", 1}, std::tuple{"tp2", "--set parallel.tp=2", 2}}) {
    SCOPED_TRACE(name);
    std::filesystem::create_directories(dir / name);
    std::filesystem::copy(dir / "zero3" / "ck", dir / name / "ck", std::filesystem::copy_options::recursive);
    std::ofstream(dir / name / "ck" / "latest") << "step-00000004\n";
    const auto tail = train(name, 6, std::string(layout) + " --resume", ranks);
    ASSERT_EQ(tail.size(), 2u);
    EXPECT_NEAR(tail[0], whole[4], 1e-4 * whole[4]);
    EXPECT_NEAR(tail[1], whole[5], 1e-4 * whole[5]);
  }
  std::filesystem::remove_all(dir);
}

// fp8 (issue 16 item 2): each recipe trains beside bf16, says at start-up that it is an emulation, and
// logs every step's overflow and underflow counts per tensor; bad recipe and format names are refused.
TEST(PrecisionCli, Fp8RecipesTrainBesideBf16SayTheyAreEmulatedAndCountWhatTheyLose) {
  auto dir = scratch_dir("fp8");
  const double bf16 = train_json(dir, "bf16")["final_loss"].get<double>();
  for (const char* recipe : {"delayed", "current", "blockwise"}) {
    SCOPED_TRACE(recipe);
    const auto out = dir / recipe;
    auto r = run_loom("train " + kTiny + "--json --set train.steps=12 --set train.eval_every=0 --set checkpoint.save_every=0 "
                      "--set precision=fp8 --set fp8.recipe=" + std::string(recipe) + " --set train.out_dir=" + out.string());
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_THAT(r.err, HasSubstr(std::string("fp8 (") + recipe + " scaling, E4M3 activations and weights, E5M2 gradients) is emulated"));
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["precision"], "fp8");
    EXPECT_NEAR(j["final_loss"].get<double>(), bf16, 2e-2 * bf16);
    std::ifstream log(out / "metrics.jsonl");
    int lines = 0;
    int64_t underflow = 0;
    for (std::string line; std::getline(log, line); ++lines) {
      const auto m = nlohmann::json::parse(line);
      ASSERT_TRUE(m.contains("fp8_overflow") && m.contains("fp8_underflow") && m["fp8_tensors"].is_object()) << line;
      int64_t per_tensor = 0;
      for (const auto& [name, counts] : m["fp8_tensors"].items()) {
        EXPECT_THAT(name, ::testing::MatchesRegex(R"(layers\.[01]\.(qkv|out|up|down)\.(input|weight|output_grad))"));
        per_tensor += counts[1].get<int64_t>();
      }
      EXPECT_EQ(per_tensor, m["fp8_underflow"].get<int64_t>());
      underflow += per_tensor;
    }
    EXPECT_EQ(lines, 12);
    EXPECT_GT(underflow, 0) << "a 3-bit mantissa loses the smallest values of some tensor";
  }
  expect_refused("train " + kTiny + "--set precision=fp8 --set fp8.recipe=tensorwise",
                 "fp8.recipe = \"tensorwise\" is not a recipe (valid: \"delayed\", \"current\", \"blockwise\")");
  expect_refused("train " + kTiny + "--set precision=fp8 --set fp8.grad_format=e3m4",
                 "fp8.grad_format = \"e3m4\" is not an fp8 format");
  std::filesystem::remove_all(dir);
}

// Delayed scaling's state: amaxes are reduced over every rank, so layouts agree (within fp8's own
// rounding: an element that lands on the other side of a rounding boundary moves by a 16th); the
// histories are saved in the checkpoint, so a resumed run continues bitwise, and they are what
// scales the next step (a checkpoint whose histories are changed continues differently).
TEST(PrecisionCli, Fp8DelayedScalingAgreesAcrossLayoutsAndResumesBitwise) {
  auto v = run_loom("verify " + kTiny + "--steps 6 --set precision=fp8 --set train.batch_size=8 "
                    "--set train.micro_batch_size=2 --tolerance 1e-3 --layouts \"dp=1;dp=2,zero=3;tp=2,sp=1;pp=2\"");
  EXPECT_EQ(v.rc, 0) << v.out << v.err;
  EXPECT_EQ(count(v.out, "PASS"), 3) << v.out;

  auto dir = scratch_dir("fp8-ck");
  auto train = [&](const std::string& name, const std::string& extra) {
    auto r = run_loom("train " + kTiny + "--quiet --set precision=fp8 --set train.steps=6 --set train.eval_every=0 "
                      "--set checkpoint.save_every=2 --set train.out_dir=" + (dir / name / "out").string() +
                      " --save-dir " + (dir / name / "ck").string() + " " + extra);
    EXPECT_EQ(r.rc, 0) << r.err;
    return losses(dir / name / "out");
  };
  auto resume_from_step_4 = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    std::filesystem::create_directories(dir / name);
    std::filesystem::copy(dir / "whole" / "ck", dir / name / "ck", std::filesystem::copy_options::recursive);
    std::ofstream(dir / name / "ck" / "latest") << "step-00000004\n";
    if (edit) {
      const auto path = dir / name / "ck" / "step-00000004" / "manifest.json";
      nlohmann::json m = nlohmann::json::parse(std::ifstream(path));
      edit(m);
      std::ofstream(path) << m.dump();
    }
    return train(name, "--resume");
  };
  const auto whole = train("whole", "");
  ASSERT_EQ(whole.size(), 6u);
  const auto manifest = nlohmann::json::parse(std::ifstream(dir / "whole" / "ck" / "step-00000004" / "manifest.json"));
  ASSERT_TRUE(manifest.contains("fp8")) << manifest.dump();
  EXPECT_EQ(manifest["fp8"]["recipe"], "delayed");
  EXPECT_EQ(manifest["fp8"]["amax_history"]["layers.1.down.output_grad"].size(), 4u) << "one amax per step so far";
  const auto resumed = resume_from_step_4("again", nullptr);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], whole[4]);  // bitwise
  EXPECT_EQ(resumed[1], whole[5]);
  const auto moved = resume_from_step_4("moved", [](nlohmann::json& m) {
    for (auto& [name, history] : m["fp8"]["amax_history"].items())
      for (auto& a : history) a = a.get<double>() * 1024;  // ten powers of two: every scale shrinks
  });
  ASSERT_EQ(moved.size(), 2u);
  EXPECT_NE(moved[0], whole[4]);
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
  expect_refused("verify --numerics " + kTiny + "--precisions \"fp32;fp7\"",
                 "--precisions: 'fp7': precision = 'fp7' is not supported");
  std::filesystem::remove_all(dir);
}

TEST(PrecisionCli, AnUnknownPrecisionIsRefusedNamingTheValidOnes) {
  expect_refused("train " + kTiny + "--set precision=bf16-impure",
                 "precision = 'bf16-impure' is not supported (valid: \"fp32\", \"bf16\", \"bf16-sr\", \"bf16-pure\", "
                 "\"fp8\")");
}

}  // namespace
}  // namespace loom::test
