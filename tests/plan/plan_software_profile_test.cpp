// Software profiles (issue 17 item 3): every assumption a prediction makes about the training stack
// is fixed by a named profile or a TOML file, the search honours it (SP, ZeRO stages, recompute),
// every prediction prints it, and validation rows name theirs.
#include <gtest/gtest.h>

#include <set>

#include <nlohmann/json.hpp>

#include "../cli/cli_runner.h"
#include "../test_support.h"
#include "loom/error.h"
#include "loom/plan/search.h"
#include "loom/plan/software_profile.h"
#include "loom/plan/time_model.h"
#include "loom/plan/validation.h"

namespace loom::plan {
namespace {

const std::vector<std::string> kDirs = {LOOM_SOURCE_DIR "/configs/hardware"};

Job job(const std::string& profile, const std::string& precision = "bf16") {
  Job j;
  j.model = plan_model("llama3-8b");
  j.cluster = resolve_cluster("h100:16", kDirs);
  j.seq = 4096, j.global_batch = 64, j.precision = precision;
  j.software = software_profile(profile);
  return j;
}

std::string error_of(const std::function<void()>& f) { return test::config_error_of(f); }

TEST(SoftwareProfile, NamedProfilesFixTheirAssumptions) {
  const Software megatron = software_profile("megatron"), old = software_profile("megatron-2021"),
                 ds = software_profile("deepspeed"), neuron = software_profile("neuron"), loom = software_profile("loom");
  EXPECT_TRUE(megatron.flash_attention && megatron.dp_overlap && megatron.sequence_parallel && !megatron.dropout);
  EXPECT_EQ(megatron.max_zero, 3);
  EXPECT_TRUE(!old.flash_attention && old.dropout && !old.dp_overlap && old.max_zero == 0);
  EXPECT_TRUE(!ds.sequence_parallel && ds.grad_bytes == 2);
  EXPECT_EQ(neuron.max_zero, 1);
  EXPECT_TRUE(loom.loom_engine);
  for (const auto& name : software_profile_names()) EXPECT_EQ(software_profile(name).profile, name);
  // Only the PyTorch FSDP stacks run slower per FLOP without recompute (fitted; the Validation tests
  // check the shipped value is the fit), and the prediction says so.
  for (const auto& name : software_profile_names())
    EXPECT_EQ(software_profile(name).no_recompute_slowdown > 0, name == "pytorch-fsdp") << name;
  EXPECT_NE(describe(software_profile("pytorch-fsdp")).find("% slower without full recompute"), std::string::npos);
  EXPECT_EQ(describe(ds), "deepspeed (flash attention, DP overlapped, TP exposed, SP never, ZeRO up to 3, recompute "
                          "searched, gradients reduced in 2 bytes, fp8 delayed)");
  EXPECT_NE(error_of([] { software_profile("fairseq"); }).find("software profile 'fairseq' is not known (valid: megatron, "),
            std::string::npos);
}

TEST(SoftwareProfile, ACustomProfileStartsFromABaseAndRefusesUnknownKeys) {
  const Software s = parse_software_profile(R"(
[software]
base = "deepspeed"
name = "my-stack"
dropout = true
max_zero = 2
recompute = "full"
fp8_recipe = "current"
)", "my.toml");
  EXPECT_EQ(s.profile, "my-stack");
  EXPECT_TRUE(s.dropout && !s.sequence_parallel && s.grad_bytes == 2 && s.max_zero == 2);
  EXPECT_EQ(s.recompute, Recompute::Full);
  EXPECT_EQ(s.fp8_recipe, "current");
  auto err = [](const std::string& text) { return error_of([&] { parse_software_profile(text, "p.toml"); }); };
  EXPECT_EQ(err("[software]\nflash = true\n"), "p.toml: software.flash is not a software profile key");
  EXPECT_EQ(parse_software_profile("[software]\nbase = \"pytorch-fsdp\"\nno_recompute_slowdown = 0.05\n", "f.toml")
                .no_recompute_slowdown,
            0.05);
  EXPECT_EQ(err("[software]\nno_recompute_slowdown = 2\n"),
            "p.toml: software.no_recompute_slowdown must be a number in [0, 1] (the fraction by which a run without "
            "activation recompute runs slower than its kernels' sum)");
  EXPECT_EQ(err("[software]\ngrad_bytes = 3\n"), "p.toml: software.grad_bytes must be 2 (16-bit gradient reduction) or 4 (fp32)");
  EXPECT_EQ(err("[software]\nrecompute = \"some\"\n"),
            "p.toml: software.recompute = \"some\" is not \"search\", \"none\", \"selective\" or \"full\"");
  EXPECT_EQ(err("[software]\ndp_overlap = 1\n"), "p.toml: software.dp_overlap must be true or false");
  EXPECT_EQ(err("name = \"x\"\n"), "p.toml: a software profile needs a [software] table");
  EXPECT_NE(err("[software]\nbase = \"titan\"\n").find("software profile 'titan' is not known"), std::string::npos);
}

TEST(SoftwareProfile, TheSearchRunsOnlyWhatTheProfileRuns) {
  auto layouts = [](const Job& j, const Fixed& f = {}) { return search(j, f, 100000).ranked; };
  bool megatron_sp = false, megatron_zero3 = false;
  for (const auto& c : layouts(job("megatron"))) megatron_sp |= c.layout.sp, megatron_zero3 |= c.layout.zero == 3;
  EXPECT_TRUE(megatron_sp && megatron_zero3);
  for (const auto& c : layouts(job("deepspeed"))) EXPECT_FALSE(c.layout.sp) << c.layout.str();
  for (const auto& c : layouts(job("neuron"))) EXPECT_LE(c.layout.zero, 1) << c.layout.str();
  Job full = job("megatron");
  full.software.recompute = Recompute::Full;
  for (const auto& c : layouts(full)) EXPECT_EQ(c.layout.recompute, Recompute::Full) << c.layout.str();
  // A --fix beyond the profile is refused, saying which profile and why.
  Fixed zero3;
  zero3.zero = 3;
  const std::string why = error_of([&] { search(job("neuron"), zero3, 5); });
  EXPECT_NE(why.find("the software profile neuron shards to ZeRO-1 at most"), std::string::npos) << why;
}

TEST(SoftwareProfile, OnlyAStackWithAZeroBubbleScheduleIsPlannedWithOne) {
  auto schedules = [](const Job& j) {
    Fixed f;
    f.pp = 4;
    std::set<Schedule> out;
    for (const auto& c : search(j, f, 100000).ranked) out.insert(c.layout.schedule);
    return out;
  };
  EXPECT_FALSE(schedules(job("megatron")).count(Schedule::ZeroBubble));
  EXPECT_FALSE(schedules(job("neuron")).count(Schedule::ZeroBubble));
  EXPECT_TRUE(software_profile("loom").zero_bubble);
  Job zb = job("megatron");
  zb.software.zero_bubble = true;
  EXPECT_TRUE(schedules(zb).count(Schedule::ZeroBubble));
  Fixed f;
  f.pp = 4, f.schedule = Schedule::ZeroBubble;
  const std::string why = error_of([&] { search(job("nemo"), f, 5); });
  EXPECT_NE(why.find("the software profile nemo has no zero-bubble schedule"), std::string::npos) << why;
}

TEST(SoftwareProfile, GradientsAreHeldInTheDtypeTheyAreReducedIn) {
  // NeMo reduces (and so buffers) gradients in bf16: half of Megatron's fp32 main_grad.
  Fixed f;
  f.dp = 16, f.tp = 1, f.pp = 1, f.cp = 1, f.micro_batch = 1, f.zero = 1, f.recompute = Recompute::Full;
  const auto megatron = search(job("megatron"), f, 1).ranked.at(0), nemo = search(job("nemo"), f, 1).ranked.at(0);
  EXPECT_DOUBLE_EQ(nemo.memory.grads * 2, megatron.memory.grads);
  EXPECT_EQ(software_profile("nemo").max_zero, 1);
}

TEST(SoftwareProfile, CurrentFp8ScalingCostsAnAmaxPassMoreThanDelayed) {
  Job delayed = job("megatron", "fp8"), current = delayed;
  current.software.fp8_recipe = "current";
  Fixed f;
  f.dp = 2, f.tp = 8, f.pp = 1, f.cp = 1, f.micro_batch = 1, f.zero = 1;
  const auto a = search(delayed, f, 1).ranked.at(0), b = search(current, f, 1).ranked.at(0);
  ASSERT_EQ(a.layout.str(), b.layout.str());
  EXPECT_GT(b.time.memory_bound, a.time.memory_bound);
  EXPECT_EQ(b.time.model_flops, a.time.model_flops);
}

// The attention kernel: FlashAttention-2 class by default; "triton" (llm-foundry's MPT) runs the
// attention core 1.8x slower (the FlashAttention-2 paper's range, not fitted) and nothing else; the
// profile line names it, and an unknown kernel is refused naming the valid ones.
TEST(SoftwareProfile, ATritonAttentionKernelRunsTheAttentionCoreSlowerAndNothingElse) {
  Job fa2 = job("pytorch-fsdp"), triton = fa2;
  EXPECT_EQ(fa2.software.attention_kernel, "flash2");
  set_attention_kernel(triton.software, "triton");
  const Layout l{.dp = 16, .micro_batch = 1, .zero = 3, .recompute = Recompute::Full};
  const StepTime a = step_time(l, fa2), b = step_time(l, triton);
  EXPECT_NEAR(b.attention / a.attention, 1.8, 1e-9);
  EXPECT_DOUBLE_EQ(b.compute, a.compute);
  EXPECT_DOUBLE_EQ(b.model_flops, a.model_flops);
  EXPECT_GT(b.total, a.total);
  EXPECT_NE(describe(triton.software).find("flash (triton) attention"), std::string::npos) << describe(triton.software);
  const Software t = parse_software_profile("[software]\nbase = \"pytorch-fsdp\"\nattention_kernel = \"triton\"\n", "t.toml");
  EXPECT_DOUBLE_EQ(t.attention_speed(), 1 / 1.8);
  EXPECT_EQ(error_of([] {
              parse_software_profile("[software]\nflash_attention = false\nattention_kernel = \"triton\"\n", "p.toml");
            }),
            "p.toml: software.attention_kernel names a flash-attention kernel, but flash_attention = false "
            "(materialised scores)");
  EXPECT_EQ(error_of([] { parse_software_profile("[software]\nattention_kernel = \"fa9\"\n", "p.toml"); }),
            "p.toml: software.attention_kernel = \"fa9\" is not a known attention kernel (valid: flash2, triton)");
}

// Collectives that run on the compute cores (a CPU machine shared by its ranks) are never hidden: the
// data-parallel reduction and ZeRO-3's two gathers per micro-batch are priced in full, and the
// profile line says so.
TEST(SoftwareProfile, CollectivesOnTheComputeCoresAreNeverHidden) {
  Job hidden = job("loom"), shared = hidden;
  shared.software.comm_on_compute_cores = true;
  for (int zero : {0, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    const Layout l{.dp = 16, .micro_batch = 1, .zero = zero, .recompute = Recompute::Full};
    const StepTime a = step_time(l, hidden), b = step_time(l, shared);
    EXPECT_GT(b.dp + b.zero, a.dp + a.zero);
    EXPECT_EQ(b.compute, a.compute);
    // What the hidden job overlaps slows its compute (the device's overlap_slowdown); nothing is
    // overlapped on the compute cores.
    EXPECT_EQ(b.overlap, 0);
    EXPECT_NEAR(b.total - a.total, (b.dp + b.zero) - (a.dp + a.zero + a.overlap), 1e-12 * b.total);
  }
  // TP's collectives too: Loom's overlap (weight-gradient GEMMs under the input-gradient collective)
  // hides nothing when the collective needs the same cores.
  hidden.software.tp_overlap = shared.software.tp_overlap = true;
  const Layout tp{.dp = 2, .tp = 8, .micro_batch = 1, .sp = true};
  const StepTime a = step_time(tp, hidden), b = step_time(tp, shared);
  hidden.software.tp_overlap = false;
  const StepTime plain = step_time(tp, hidden);
  EXPECT_LT(a.tp, plain.tp);
  EXPECT_DOUBLE_EQ(b.tp, plain.tp);
  EXPECT_NE(describe(shared.software).find("collectives on the compute cores"), std::string::npos);
  EXPECT_EQ(describe(hidden.software).find("collectives on the compute cores"), std::string::npos);
}

TEST(SoftwareProfile, EveryPredictionAndValidationRowNamesItsProfile) {
  auto r = test::run_loom("plan --model llama3-8b --cluster h100:16 --seq 4096 --global-batch 64 --top 2 --software neuron");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("software neuron (flash attention, DP overlapped, TP exposed, SP searched, ZeRO up to 1"),
            std::string::npos) << r.out;
  r = test::run_loom("plan --model llama3-8b --cluster h100:16 --seq 4096 --global-batch 64 --top 1 --json --engine loom");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["software"], "loom");
  r = test::run_loom("plan --model llama3-8b --cluster h100:16 --seq 4096 --global-batch 64 --engine loom --software megatron");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("--engine loom and --software megatron disagree"), std::string::npos) << r.err;
  const auto rep = validate_file(LOOM_SOURCE_DIR "/tests/plan/published_results.toml", kDirs);
  for (const auto& line : rep.lines) EXPECT_EQ(line.software, "megatron-2021") << line.row;
}

}  // namespace
}  // namespace loom::plan
