// The planner against published results it was not fitted to: tests/plan/published_results_other_sources.toml
// (MosaicML, IBM, NVIDIA NeMo, AWS Neuron) beside the Megatron-paper rows, the held-out bars of issue 17,
// and the validation file's own checks (keys, sets, sources, the published layout that the memory
// model says does not fit).
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>

#include "../test_support.h"
#include "loom/error.h"
#include "loom/plan/validation.h"

using namespace loom;
using namespace loom::plan;

namespace {

const std::vector<std::string> kDirs = {LOOM_SOURCE_DIR "/configs/hardware"};
const std::string kPapers = LOOM_SOURCE_DIR "/tests/plan/published_results.toml";
const std::string kOthers = LOOM_SOURCE_DIR "/tests/plan/published_results_other_sources.toml";

std::string error_of(const std::function<void()>& f) { return test::config_error_of(f); }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string row(const std::string& extra) {
  return "[[row]]\nname = \"r\"\nmodel = \"llama2-7b\"\nhardware = \"h100\"\ndevices = 8\nseq = 4096\nglobal_batch = 64\n"
         "tp = 1\npp = 1\n" + extra;
}

}  // namespace

TEST(Validation, HeldOutRowsFromOtherSourcesMeetTheMeanWorstAndConstantBars) {
  const ValidationReport rep = validate_files({kPapers, kOthers}, kDirs);
  ASSERT_EQ(rep.sets.count("held-out"), 1u);
  const SetErrors& held = rep.sets.at("held-out");
  // Issue 17 item 4: at least 12 new rows, half of them held out, across A100, H100 and Trainium.
  EXPECT_GE(held.lines, 12);
  std::set<std::string> families;
  for (const auto& l : rep.lines)
    if (l.set == "held-out") families.insert(l.hardware);
  EXPECT_TRUE(families.count("a100") && families.count("h100") && families.count("trn1-nc"));
  EXPECT_LE(held.mean, 0.10);
  EXPECT_LE(held.ratio(), 0.6);
  EXPECT_GT(held.constant_mean, 0.15);  // the bar is a real one: no single utilisation fits these rows
  // The worst-row bar. MPT's 13B on 64 H100s at micro-batch 2 (FSDP, no recompute) was 37% fast
  // while overlapped collectives were free; with the GPUs' overlap_slowdown (a published figure, not
  // fitted) it is the worst line at ~15%.
  EXPECT_LE(held.worst, 0.20);
  // The Megatron-paper rows keep their own bars with the new rows beside them.
  const ValidationReport papers = validate_file(kPapers, kDirs);
  EXPECT_LE(papers.throughput_mean, 0.10);
  EXPECT_LE(papers.throughput_worst, 0.20);
}

TEST(Validation, EachFamilysShippedEfficiencyIsItsInSampleFit) {
  const ValidationReport rep = validate_files({kPapers, kOthers}, kDirs);
  for (const auto& f : rep.families) {
    SCOPED_TRACE(f.hardware);
    EXPECT_GT(f.in_sample_lines, 0);
    EXPECT_NEAR(f.scale, 1.0, 0.03);  // refit on in-sample rows only; held-out rows never enter it
  }
}

// A profile's no_recompute_slowdown is fitted like a family's GEMM efficiency, on in-sample rows only.
// A profile ships its fit where the fit moves its in-sample mean error by a point or more, else 0
// (NeMo's rows call for 0.07 at 0.1 points: noise, not an effect).
TEST(Validation, EachProfilesShippedNoRecomputeSlowdownIsItsInSampleFit) {
  const ValidationReport rep = validate_files({kPapers, kOthers}, kDirs);
  bool fsdp = false;
  for (const auto& p : rep.profiles) {
    SCOPED_TRACE(p.software);
    fsdp |= p.software == "pytorch-fsdp";
    if (p.shipped > 0)
      EXPECT_NEAR(p.shipped, p.fitted, 0.015);
    else
      EXPECT_LT(p.shipped_mean - p.fitted_mean, 0.01);
  }
  EXPECT_TRUE(fsdp) << "the FSDP rows without recompute are in sample";
}

// MosaicML's whole sweep (69 rows in none of the other files: 760M-13B, 1K-64K tokens, 8-64 GPUs, with
// and without checkpointing, three device types), all held out. Without the FSDP profile's
// no-recompute slowdown the model was no better than one constant utilisation on its first 36 rows
// (mean 16.0%, worst 39.9%, ratio 0.98); priced as FlashAttention-2 the rows at 16K-64K read 4-73% fast.
// Every llm-foundry row runs its Triton attention kernel.
TEST(Validation, MosaicMLsWholeSweepIsHeldOutAndWithinBounds) {
  const ValidationReport rep = validate_file(LOOM_SOURCE_DIR "/tests/plan/published_results_mpt_sweep.toml", kDirs);
  ASSERT_EQ(rep.sets.count("held-out"), 1u);
  EXPECT_EQ(rep.sets.count("in-sample"), 0u);
  const SetErrors& held = rep.sets.at("held-out");
  EXPECT_GE(held.lines, 69);
  for (const std::string file : {kOthers, std::string(LOOM_SOURCE_DIR "/tests/plan/published_results_mpt_sweep.toml")})
    for (const auto& r : parse_validation(read_file(file), file, kDirs))
      if (r.source.find("llm-foundry") != std::string::npos)
        EXPECT_EQ(r.job.software.attention_kernel, "triton") << r.name;
  EXPECT_LE(held.mean, 0.10);
  EXPECT_LE(held.worst, 0.25);
  EXPECT_LE(held.ratio(), 0.6);
}

TEST(Validation, RowsNameTheirSetAndSourceAndUnknownKeysAreRefused) {
  auto err = [](const std::string& text) { return error_of([&] { parse_validation(text, "v.toml", kDirs); }); };
  EXPECT_EQ(err(row("set = \"test\"\ntokens_per_s_per_device = 1\n")),
            "v.toml: validation row 'r': 'set' = \"test\" is not \"in-sample\" or \"held-out\"");
  EXPECT_EQ(err(row("throughput = 3\n")), "v.toml: validation row 'r': 'throughput' is not a validation row key");
  EXPECT_EQ(err(row("tokens_per_s_per_device = 1\nsequences_per_s = 2\n")),
            "v.toml: validation row 'r': 'sequences_per_s' and 'tokens_per_s_per_device' state the same figure: give one");
  EXPECT_EQ(err(row("precision = \"fp4\"\n")), "v.toml: validation row 'r': 'precision' = \"fp4\" is not \"bf16\" or \"fp8\"");
  EXPECT_EQ(err(row("zero = 4\n")), "v.toml: validation row 'r': 'zero' must be 0, 1, 2 or 3");
  EXPECT_EQ(err(row("attention_kernel = \"fa9\"\n")),
            "v.toml: validation row 'r': 'attention_kernel' = \"fa9\" is not a known attention kernel (valid: flash2, triton)");
  EXPECT_EQ(err(row("cp = 3\n")), "v.toml: validation row 'r': tp * pp * cp = 3 does not divide devices = 8");
  // Sequences per second of the whole job are read as tokens per device.
  auto rows = parse_validation(row("set = \"held-out\"\nsource = \"x\"\nsequences_per_s = 4\n"), "v.toml", kDirs);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_DOUBLE_EQ(*rows[0].tokens_per_s_per_device, 4.0 * 4096 / 8);
  EXPECT_EQ(rows[0].set, "held-out");
  // Every row of the shipped file says where it comes from.
  for (const auto& r : parse_validation(read_file(kOthers), kOthers, kDirs)) EXPECT_FALSE(r.source.empty()) << r.name;
  // Row names are unique across the files validated together.
  const std::string e = error_of([&] { validate_files({kOthers, kOthers}, kDirs); });
  EXPECT_NE(e.find("is named twice"), std::string::npos) << e;
}

TEST(Validation, APublishedLayoutTheMemoryModelRejectsIsStillPredictedAndFlagged) {
  // 70B on 8 A100s without ZeRO or recompute does not fit: the row is predicted all the same (the run
  // is a fact) and the miss is reported beside it.
  auto rows = parse_validation(
      "[[row]]\nname = \"big\"\nmodel = \"llama2-70b\"\nhardware = \"a100\"\ndevices = 8\nseq = 4096\nglobal_batch = 8\n"
      "tp = 8\npp = 1\nzero = 0\nrecompute = \"none\"\nmicro_batch = 1\ntokens_per_s_per_device = 100\n",
      "v.toml", kDirs);
  const ValidationReport rep = validate(rows);
  ASSERT_EQ(rep.over_memory.size(), 1u);
  ASSERT_EQ(rep.lines.size(), 1u);
  EXPECT_GT(rep.lines[0].predicted, 0);
  EXPECT_NE(rep.lines[0].memory_note.find("GiB usable"), std::string::npos) << rep.lines[0].memory_note;
}
