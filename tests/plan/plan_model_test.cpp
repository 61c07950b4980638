// Planner building blocks against hand-computed cases and Loom's own registries: parameter and FLOP
// counts, the memory formulas of Korthikanti et al., collective costs, GEMM time, hardware files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "loom/error.h"
#include "loom/kernels/attention.h"
#include "loom/kernels/gemm.h"
#include "loom/plan/collective_cost.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/search.h"
#include "loom/plan/time_model.h"
#include "loom/spec/param_table.h"

using namespace loom;
using namespace loom::plan;

namespace {

const std::vector<std::string> kDirs = {LOOM_SOURCE_DIR "/configs/hardware"};

Job megatron_job(const std::string& model, int devices, int64_t batch) {
  Job j;
  j.model = plan_model(model);
  j.cluster = resolve_cluster("a100:" + std::to_string(devices), kDirs);
  j.seq = 2048, j.global_batch = batch;
  j.software = {.flash_attention = false, .dropout = true, .dp_overlap = false, .tp_overlap = false, .grad_bytes = 4};
  return j;
}

}  // namespace

TEST(ModelZoo, ParameterCountsAgreeExactlyWithTheRegistryForEveryPreset) {
  for (auto& name : spec::preset_names()) {
    auto table = spec::build_param_table(spec::preset(name));
    int64_t numel = 0;
    for (auto& p : table.params()) numel += p.numel();
    EXPECT_EQ(count_params(plan_model(name)).total, numel) << name;
  }
}

TEST(ModelZoo, FlopsPerTokenAgreeWithTheSpecForDenseModels) {
  // Every preset and zoo model, MoE included: the planner's closed form against the parameter table's.
  for (auto& name : plan_model_names()) {
    auto m = plan_model(name);
    EXPECT_DOUBLE_EQ(flops_per_token(m, m.cfg.max_seq), spec::model_flops_per_token(m.cfg, m.cfg.max_seq)) << name;
  }
}

TEST(ModelZoo, LargeModelsHaveTheirPublishedSizes) {
  auto billions = [](const std::string& n) { return count_params(plan_model(n)).total * 1e-9; };
  EXPECT_NEAR(billions("gpt3-175b"), 175.0, 1.0);
  EXPECT_NEAR(billions("llama3-8b"), 8.03, 0.05);
  EXPECT_NEAR(billions("llama3-70b"), 70.6, 0.2);
  EXPECT_NEAR(billions("llama3-405b"), 405.8, 1.0);
  EXPECT_NEAR(billions("mixtral-8x7b"), 46.7, 0.1);
  EXPECT_NEAR(count_params(plan_model("mixtral-8x7b")).active * 1e-9, 12.9, 0.1);
  EXPECT_NEAR(billions("megatron-145b"), 145.6, 0.5);
  EXPECT_NEAR(billions("megatron-1t"), 1008.0, 2.0);
  // MPT: llm-foundry's benchmark tables list NumParams with an 8192-row position table (their
  // seq 8192 rows); the zoo keeps that table.
  EXPECT_EQ(count_params(plan_model("mpt-760m")).total, 769907712);
  EXPECT_EQ(count_params(plan_model("mpt-1b")).total, 1328533504);
  EXPECT_EQ(count_params(plan_model("mpt-3b")).total, 2667566080);
  EXPECT_EQ(count_params(plan_model("mpt-7b")).total, 6684024832);
  // ALiBi: the table follows the job's sequence, as the tables' NumParams at 2K and 64K do.
  EXPECT_EQ(count_params(plan_model("mpt-7b").at_sequence(2048)).total, 6658859008);
  EXPECT_EQ(count_params(plan_model("mpt-7b").at_sequence(65536)).total, 6918905856);
  EXPECT_EQ(plan_model("gpt3-175b").at_sequence(8192).cfg.max_seq, 2048) << "a learned table does not grow";
}

TEST(ModelZoo, UnknownModelIsAOneLineConfigError) {
  try {
    plan_model("gpt5");
    FAIL();
  } catch (const ConfigError& e) {
    std::string w = e.what();
    EXPECT_NE(w.find("unknown model 'gpt5'"), std::string::npos);
    EXPECT_NE(w.find("llama3-70b"), std::string::npos);
    EXPECT_EQ(w.find('\n'), std::string::npos);
  }
}

// Hand check for `tiny`: the time model's executed FLOPs equal the kernels' declared FLOPs of the
// same step (GEMMs by gemm_cost, attention by attention_cost; backward GEMMs = 2x forward).
TEST(TimeModel, ExecutedFlopsForTinyMatchTheKernelsDeclaredFlops) {
  Job j;
  j.model = plan_model("tiny");
  j.cluster = resolve_cluster("a100:1", kDirs);
  const auto& c = j.model.cfg;
  j.seq = c.max_seq, j.global_batch = 4;
  Layout l{.micro_batch = 4};
  const int64_t N = 4 * c.max_seq, C = c.d_model;
  double fwd = 0;
  for (auto d : {kernels::GemmDesc{N, 3 * C, C}, kernels::GemmDesc{N, C, C}, kernels::GemmDesc{N, c.d_ff, C},
                 kernels::GemmDesc{N, C, c.d_ff}})
    fwd += kernels::gemm_cost(d).flops;
  kernels::AttentionShape a{4, c.max_seq, c.n_heads, c.n_kv_heads, c.head_dim()};
  double attn = kernels::attention_cost(a, false).flops + kernels::attention_cost(a, true).flops;
  double head = 3 * kernels::gemm_cost({N, c.vocab_size, C}).flops;
  double declared = c.n_layers * (3 * fwd + attn) + head;
  // The planner counts attention as 3x its forward on exactly half the square; the kernel declares
  // 3.5x on T(T+1)/2 pairs: agreement within the attention share's difference (a few percent for tiny).
  EXPECT_NEAR(step_time(l, j).hardware_flops / declared, 1.0, 0.05);
}

TEST(MemoryModel, ActivationsFollowKorthikantiFormulas) {
  Job j = megatron_job("megatron-175b", 8, 8);
  const double s = 2048, b = 1, h = 12288, a = 96, t = 8, sbh = s * b * h;
  Layout l{.tp = 8, .micro_batch = 1};
  EXPECT_NEAR(activation_bytes_per_layer(l, j), sbh * (10 + 24 / t + 5 * a * s / (h * t)), 1);
  l.sp = true;
  EXPECT_NEAR(activation_bytes_per_layer(l, j), sbh * (34 / t + 5 * a * s / (h * t)), 1);
  l.recompute = Recompute::Selective;
  EXPECT_NEAR(activation_bytes_per_layer(l, j), 34 * sbh / t, 1);
  l.sp = false;
  EXPECT_NEAR(activation_bytes_per_layer(l, j), sbh * (10 + 24 / t), 1);
  l.recompute = Recompute::Full;
  EXPECT_NEAR(activation_bytes_per_layer(l, j), 2 * sbh, 1);
  Layout none{.tp = 1};
  EXPECT_NEAR(activation_bytes_per_layer(none, j), sbh * (34 + 5 * a * s / h), 1);
}

TEST(MemoryModel, ScheduleSetsMicroBatchesInFlight) {
  Job j = megatron_job("megatron-175b", 64, 64);  // m = 64 micro-batches of 1
  Layout l{.tp = 8, .pp = 8, .micro_batch = 1, .schedule = Schedule::GPipe};
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, j), 64);
  l.schedule = Schedule::OneFOneB;
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, j), 8);
  l.schedule = Schedule::Interleaved, l.vpp = 3;
  EXPECT_DOUBLE_EQ(in_flight_micro_batches(l, j), 8 * (1 + 7.0 / 24));
}

TEST(MemoryModel, ZeroStagesShardStateOverDataParallelRanks) {
  Job j = megatron_job("megatron-7.5b", 64, 512);
  Layout l{.dp = 16, .tp = 4, .micro_batch = 1, .recompute = Recompute::Full};
  auto m0 = memory_per_device(l, j);
  const double P = stage_params(l, j, true).dense;
  EXPECT_NEAR(m0.weights, 2 * P, 1);
  EXPECT_NEAR(m0.grads, 4 * P, 1);
  EXPECT_NEAR(m0.optimizer, 12 * P, 1);
  l.zero = 1;
  EXPECT_NEAR(memory_per_device(l, j).optimizer, 12 * P / 16, 1);
  l.zero = 2;
  EXPECT_NEAR(memory_per_device(l, j).grads, 4 * P / 16, 1);
  l.zero = 3;
  EXPECT_NEAR(memory_per_device(l, j).weights, 2 * P / 16, 1);
}

// Routing imbalance sizes the expert work by the busiest rank: slower steps, more activation and
// dispatch memory for a mixture of experts; a dense model does not notice.
TEST(TimeModel, MoeImbalanceSlowsExpertWorkOnlyForMixturesOfExperts) {
  Job moe;
  moe.model = plan_model("mixtral-8x7b");
  moe.cluster = resolve_cluster("h100:32", kDirs);
  moe.seq = 4096, moe.global_batch = 64;
  const Layout l{.dp = 8, .tp = 4, .ep = 8, .micro_batch = 1};
  ASSERT_TRUE(check_layout(l, moe).ok()) << check_layout(l, moe).why;
  const StepTime uniform = step_time(l, moe);
  const MemoryBreakdown uniform_mem = memory_per_device(l, moe);
  moe.software.moe_imbalance = 1.5;
  const StepTime skewed = step_time(l, moe);
  EXPECT_GT(skewed.compute, uniform.compute * 1.1);  // the expert MLPs are most of the GEMM time
  EXPECT_GT(skewed.ep, uniform.ep * 1.4);             // dispatch bytes scale with the busiest rank
  EXPECT_GT(memory_per_device(l, moe).activations, uniform_mem.activations);
  EXPECT_DOUBLE_EQ(skewed.model_flops, uniform.model_flops);  // MFU still counts the useful FLOPs

  Job dense = megatron_job("megatron-7.5b", 64, 512);
  const Layout d{.dp = 16, .tp = 4, .micro_batch = 1};
  const double before = step_time(d, dense).total;
  dense.software.moe_imbalance = 1.5;
  EXPECT_DOUBLE_EQ(step_time(d, dense).total, before);
}

// fp8 (Transformer Engine's recipe): the linear GEMMs run at the fp8 peak, but the casts cost memory
// traffic, attention and the LM head stay 16-bit, the layers keep fp8 weight copies, and the linear
// layers save their inputs in one byte.
TEST(TimeModel, Fp8HalvesLinearGemmTimeAndPaysForItsCastsAndWeightCopies) {
  Job j;
  j.model = plan_model("llama3-8b");
  j.cluster = resolve_cluster("h100:8", kDirs);
  j.seq = 8192, j.global_batch = 8;
  const Layout l{.dp = 8, .micro_batch = 1};
  const StepTime bf16 = step_time(l, j);
  const MemoryBreakdown bf16_mem = memory_per_device(l, j);
  j.precision = "fp8";
  const StepTime fp8 = step_time(l, j);
  const MemoryBreakdown fp8_mem = memory_per_device(l, j);
  // Linear GEMMs at twice the peak; attention (a large share at seq 8192) and the head do not speed up.
  EXPECT_LT(fp8.compute, 0.75 * bf16.compute);
  EXPECT_GT(fp8.compute, 0.5 * bf16.compute);
  EXPECT_GT(fp8.memory_bound, bf16.memory_bound);  // the casts
  EXPECT_LT(fp8.total, bf16.total);
  EXPECT_DOUBLE_EQ(fp8.hardware_flops, bf16.hardware_flops);
  // fp8 copy + transpose of every layer weight: 2 bytes per layer parameter.
  const ParamCounts pc = count_params(j.model);
  EXPECT_NEAR(fp8_mem.weights - bf16_mem.weights, 2.0 * j.model.cfg.n_layers * pc.per_layer, 1);
  // Saved activations: the four linear inputs in one byte. Llama-3-8B per sbh: replicated 8 -> 6,
  // split 2 + 4 kv + 2 + 6 F -> 2 + 4 kv + 1 + 5 F (no dropout; flash attention's statistics aside).
  const double h = 4096, kv = 8.0 / 32, F = 14336 / h;
  const double per_sbh_bf16 = 8 + 2 + 4 * kv + 2 + 6 * F, per_sbh_fp8 = 6 + 2 + 4 * kv + 1 + 5 * F;
  Job bj = j;
  bj.precision = "bf16";
  EXPECT_NEAR(activation_bytes_per_layer(l, j) - activation_bytes_per_layer(l, bj),
              8192.0 * h * (per_sbh_fp8 - per_sbh_bf16), 1);
  // No fp8 peak, no fp8 plan.
  Job a = megatron_job("megatron-7.5b", 8, 8);
  a.precision = "fp8";
  EXPECT_THROW(step_time(Layout{.dp = 8}, a), ConfigError);
}

// TP communication overlap (Megatron-Core --tp-comm-overlap, with SP): each block's collectives hide
// under its GEMMs. On a fast link all but one chunk in tp hides; on a slow one exactly the GEMM time
// is saved; without SP nothing changes.
TEST(TimeModel, TpOverlapHidesCollectivesUnderTheBlocksGemms) {
  Job j = megatron_job("megatron-175b", 8, 8);
  Layout l{.tp = 8, .micro_batch = 1, .sp = true, .recompute = Recompute::Selective};
  const StepTime exposed = step_time(l, j);
  j.software.tp_overlap = true;
  const StepTime hidden = step_time(l, j);
  EXPECT_NEAR(hidden.tp, exposed.tp / 8, 1e-9 * exposed.tp);  // NVSwitch: comm < GEMMs, one chunk of 8 left
  EXPECT_LT(hidden.total, exposed.total);
  EXPECT_DOUBLE_EQ(hidden.compute, exposed.compute);

  j.cluster.hw.intra_node.bandwidth /= 1000;  // a link far slower than the GEMMs
  j.software.tp_overlap = false;
  const StepTime slow = step_time(l, j);
  j.software.tp_overlap = true;
  const StepTime slow_hidden = step_time(l, j);
  // Each block hides exactly its GEMMs: forward once, backward twice, i.e. all the step's GEMM compute
  // but the LM head's (0.4% of it for this model).
  EXPECT_NEAR(slow.tp - slow_hidden.tp, slow.compute, 0.01 * slow.compute);
  EXPECT_LT(slow.tp - slow_hidden.tp, slow.compute);

  l.sp = false;  // Megatron's overlap needs SP
  j.software.tp_overlap = false;
  const double plain = step_time(l, j).tp;
  j.software.tp_overlap = true;
  EXPECT_DOUBLE_EQ(step_time(l, j).tp, plain);
}

// Overlapped communication is not free: compute under it runs efficiency.overlap_slowdown slower
// (on GPUs the collective's kernels take SMs and memory bandwidth). A gradient all-reduce the backward
// hides entirely costs that fraction of its own time; exposed, it costs all of it; with no slowdown
// the overlap is free, as before.
TEST(TimeModel, OverlappedCommunicationSlowsTheComputeUnderIt) {
  Job j = megatron_job("llama3-8b", 8, 256);
  const Layout l{.dp = 8, .micro_batch = 1, .recompute = Recompute::Full};
  const StepTime exposed = step_time(l, j);  // dp_overlap off: the all-reduce is all exposed
  ASSERT_GT(exposed.dp, 0);
  EXPECT_EQ(exposed.overlap, 0);
  j.software.dp_overlap = true;
  j.cluster.hw.efficiency.overlap_slowdown = 0;
  const StepTime free_overlap = step_time(l, j);
  ASSERT_EQ(free_overlap.dp, 0) << "32 micro-batches: the last one's backward hides the all-reduce";
  EXPECT_EQ(free_overlap.overlap, 0);
  EXPECT_NEAR(exposed.total - free_overlap.total, exposed.dp, 1e-9 * exposed.total);
  for (double s : {0.189, 0.4}) {
    j.cluster.hw.efficiency.overlap_slowdown = s;
    const StepTime slowed = step_time(l, j);
    EXPECT_NEAR(slowed.overlap, s * exposed.dp, 1e-9 * exposed.dp) << s;
    EXPECT_DOUBLE_EQ(slowed.compute, free_overlap.compute);
    EXPECT_NEAR(slowed.total, free_overlap.total + slowed.overlap, 1e-12 * slowed.total);
    EXPECT_LT(slowed.total, exposed.total);  // still better than not overlapping
  }
  // ZeRO-3's gathers, hidden under a layer each, slow it too: linearly in the slowdown.
  const Layout z3{.dp = 8, .micro_batch = 1, .zero = 3, .recompute = Recompute::Full};
  j.cluster.hw.efficiency.overlap_slowdown = 0.2;
  const double a = step_time(z3, j).overlap;
  j.cluster.hw.efficiency.overlap_slowdown = 0.4;
  EXPECT_GT(a, 0);
  EXPECT_NEAR(step_time(z3, j).overlap, 2 * a, 1e-9 * a);
}

// ZeRO-3 keeps no full copy of the weights: unlike ZeRO-1/2 it gathers no updated weights after the
// step (it gathers each unit as the next step uses it, priced in `zero`). With nothing hidden, ZeRO-1
// pays one reduce-scatter and the after-step gather, ZeRO-2 a reduce-scatter per micro-batch and the
// gather, ZeRO-3 the reduce-scatters alone.
TEST(TimeModel, ZeroThreeReduceScattersEveryMicroBatchAndGathersNothingAfterTheStep) {
  Job j = megatron_job("llama3-8b", 16, 64);
  j.software.comm_on_compute_cores = true;  // every collective exposed
  Layout l{.dp = 16, .micro_batch = 1, .zero = 1, .recompute = Recompute::Full};
  const double m = static_cast<double>(micro_batches(l, j));
  ASSERT_GT(m, 1);
  const double z1 = step_time(l, j).dp;
  l.zero = 2;
  const double z2 = step_time(l, j).dp;
  const double rs = (z2 - z1) / (m - 1), gather_after = z1 - rs;
  ASSERT_GT(rs, 0);
  ASSERT_GT(gather_after, 0);
  l.zero = 3;
  const StepTime z3 = step_time(l, j);
  EXPECT_NEAR(z3.dp, m * rs, 1e-9 * z3.dp);
  EXPECT_GT(z3.zero, 0);  // its own gathers, forward and backward of every micro-batch
  // Hidden (a GPU's own communication engine): the backward's gathers and reduce-scatters share one
  // link and the backward's time; the forward hides only its gathers. A slower link exposes more.
  j.software.comm_on_compute_cores = false;
  const StepTime fast = step_time(l, j);
  j.cluster.hw.inter_node.bandwidth /= 20;
  const StepTime slow = step_time(l, j);
  EXPECT_GT(slow.zero + slow.dp, fast.zero + fast.dp);
  EXPECT_LE(fast.zero + fast.dp, z3.zero + z3.dp);
}

// The attention core is priced inside the memory-bound time, but a step it dominates (long sequences)
// is bound by compute: Llama 3 405B at 128K tokens had been called memory-bound.
TEST(TimeModel, AStepDominatedByTheAttentionCoreIsBoundByCompute) {
  StepTime t;
  t.compute = 1, t.memory_bound = 3, t.attention = 2.5, t.comm_exposed = 0.5;
  EXPECT_EQ(t.bound(), "compute");
  t.attention_is_compute = false;  // materialised scores: the core is also their memory passes
  EXPECT_EQ(t.bound(), "memory");
  t.attention_is_compute = true, t.attention = 0.5;
  EXPECT_EQ(t.bound(), "memory");
  Job j = megatron_job("llama3-8b", 64, 64);
  j.software = Software{};  // Megatron-Core today: flash attention
  j.seq = 131072;
  const Layout l{.dp = 4, .tp = 1, .cp = 16, .micro_batch = 1, .zero = 3, .recompute = Recompute::Full};
  const StepTime longer = step_time(l, j);
  ASSERT_GT(longer.attention, longer.compute) << "at 128K tokens attention outweighs the projections";
  EXPECT_EQ(longer.bound(), "compute");
}

TEST(CollectiveCost, AlphaBetaWithNcclTestsBusBandwidthFactors) {
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::AllReduce, 8), 2 * 7.0 / 8);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::AllGather, 4), 3.0 / 4);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::AllReduce, 1), 0);
  Link ring{100e9, 2e-6, Topology::Ring};
  // 8-rank ring all_reduce of 1 GB: 2*7 hops of 2 us + 1e9 * 1.75 / (100e9 * 0.5)
  EXPECT_NEAR(collective_time(Collective::AllReduce, 1e9, 8, ring, 0.5), 14 * 2e-6 + 1.75e9 / 50e9, 1e-12);
  Link torus{100e9, 2e-6, Topology::Torus};
  EXPECT_DOUBLE_EQ(latency_steps(Collective::AllGather, 16, Topology::Torus), 6);
  EXPECT_LT(collective_time(Collective::AllGather, 1e3, 16, torus, 1), collective_time(Collective::AllGather, 1e3, 16, ring, 1));
}

TEST(CollectiveCost, HierarchicalAllReduceIsNodeLocalThenAcrossNodes) {
  Hardware hw = resolve_cluster("a100:16", kDirs).hw;
  const double S = 1e9, e = hw.efficiency.link;
  double expect = collective_time(Collective::ReduceScatter, S, 8, hw.intra_node, e) +
                  collective_time(Collective::AllReduce, S / 8, 2, hw.inter_node, e) +
                  collective_time(Collective::AllGather, S, 8, hw.intra_node, e);
  EXPECT_DOUBLE_EQ(group_collective_time(Collective::AllReduce, S, {16, 8}, hw), expect);
  // One rank per node: the whole buffer crosses the network.
  EXPECT_DOUBLE_EQ(group_collective_time(Collective::AllReduce, S, {4, 1}, hw),
                   collective_time(Collective::AllReduce, S, 4, hw.inter_node, e));
}

TEST(TimeModel, GemmTimeIsComputeBoundForLargeAndMemoryBoundForThinShapes) {
  Hardware hw = resolve_cluster("a100:1", kDirs).hw;
  const double peak = 312e12;
  const double d = 8192, fill = d / (d + hw.efficiency.gemm_half_dim);
  EXPECT_NEAR(gemm_time({d, d, d}, hw, peak, 2), 2 * d * d * d / (peak * hw.efficiency.gemm_max * fill * fill * fill), 1e-9);
  // A matrix-vector-like product moves its bytes: roofline on bandwidth.
  const double bytes = 2 * (8192.0 * 8192 + 8192 + 8192);
  EXPECT_NEAR(gemm_time({1, 8192, 8192}, hw, peak, 2), bytes / (hw.device.memory_bandwidth * hw.efficiency.memory), 1e-12);
}

TEST(Hardware, ShippedFilesParseAndRoundTrip) {
  for (auto& name : {"a100", "h100", "trn1", "trn2"}) {
    Cluster c = resolve_cluster(std::string(name) + ":32", kDirs);
    EXPECT_EQ(c.devices, 32);
    Hardware back = parse_hardware(hardware_to_toml(c.hw, "round trip"), "mem.toml");
    EXPECT_NEAR(back.device.peak_bf16, c.hw.device.peak_bf16, 1);
    EXPECT_NEAR(back.inter_node.bandwidth, c.hw.inter_node.bandwidth, 1);
    EXPECT_EQ(back.intra_node.topology, c.hw.intra_node.topology);
    EXPECT_EQ(back.devices_per_node, c.hw.devices_per_node);
  }
  EXPECT_EQ(resolve_cluster("trn2", kDirs).devices, 16);  // one node by default
}

TEST(Hardware, BadClusterOrFileIsAOneLineConfigError) {
  EXPECT_THROW(resolve_cluster("tpu-v9:8", kDirs), ConfigError);
  EXPECT_THROW(resolve_cluster("a100:0", kDirs), ConfigError);
  EXPECT_THROW(resolve_cluster("a100:many", kDirs), ConfigError);
  EXPECT_THROW(parse_hardware("name = \"x\"\n[device]\nmemory_GiB = 1\n", "x.toml"), ConfigError);
  try {
    resolve_cluster("tpu-v9", kDirs);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("a100"), std::string::npos);
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

// tp beyond the KV heads (Llama 3 70B: 8 KV heads at tp 16, the usual Trainium layout) replicates each
// KV head over tp / n_kv_heads ranks (NeuronX Distributed): the layout is accepted; each rank holds and
// computes one head's K and V projections (the weights and the executed FLOPs grow by exactly that);
// the replicas' K and V weight gradients are summed once per step; tp and KV heads that divide neither
// way are still refused.
TEST(KvReplication, TpBeyondTheKvHeadsReplicatesThemAndPricesIt) {
  Job j = megatron_job("llama3-70b", 64, 64);
  j.cluster = resolve_cluster("trn1:64", kDirs);
  j.software = Software{};
  j.seq = 4096;
  const auto& c = j.model.cfg;
  Layout l16{.dp = 1, .tp = 16, .pp = 4, .micro_batch = 1, .sp = true};
  EXPECT_TRUE(check_layout(l16, j).ok()) << check_layout(l16, j).why;
  // Weights: one replicated head's K and V per rank instead of 8/16 of a head.
  const double kv_head = 2.0 * c.head_dim() * c.d_model, layers16 = c.n_layers / 4.0;
  const double dense = static_cast<double>(count_params(j.model).per_layer);
  EXPECT_NEAR(stage_params(l16, j, false).dense - static_cast<double>(count_params(j.model).embedding) / 16,
              layers16 * (dense / 16 + kv_head * (1 - 8.0 / 16)), 1.0);
  // Executed FLOPs: at tp 8 every rank projects one KV head, at tp 16 too -- eight more heads' K and V
  // in all, forward and backward (3 passes), every layer and micro-batch.
  Layout a = l16, b = l16;
  b.tp = 8, b.pp = 4, b.dp = 2;  // the same step on half the tp (executed FLOPs are the whole step's)
  const double m = static_cast<double>(micro_batches(a, j));
  const double n = static_cast<double>(j.seq) * a.micro_batch;
  const double extra = 3.0 * 2 * n * c.d_model * 2 * c.head_dim() * (16 - 8) * c.n_layers * m;
  EXPECT_NEAR(step_time(a, j).hardware_flops - step_time(b, j).hardware_flops, extra, 1e-9 * extra);
  // The replicas' gradient sum is exposed communication that split KV heads do not have.
  Job split = j;
  split.model.cfg.n_kv_heads = 16;
  EXPECT_GT(step_time(l16, j).tp, step_time(l16, split).tp);
  // Neither divides the other: refused, naming both.
  Job odd = j;
  odd.model.cfg.n_kv_heads = 6, odd.model.cfg.n_heads = 48, odd.model.cfg.d_model = 6144;
  const Verdict v = check_layout(l16, odd);
  EXPECT_FALSE(v.ok());
  EXPECT_NE(v.why.find("6 KV heads"), std::string::npos) << v.why;
}

// Uneven pipeline stages for any profile (--pipeline-layers): Llama 3 405B's 126 layers on 16 stages
// with the first and last trimmed (7, 14 x 8, 7), as real runs cut them. Every stage is priced and the
// slowest kept; the heaviest stage's memory is the device's; a list that does not hold the model, or a
// layout with another number of chunks, is refused.
TEST(UnevenStages, TrimmedFirstAndLastStagesArePricedStageByStage) {
  Job j = megatron_job("llama3-405b", 1024, 512);
  j.cluster = resolve_cluster("h100:1024", kDirs);
  j.software = Software{};
  j.seq = 8192;
  std::vector<int64_t> cut{7};
  for (int i = 0; i < 14; ++i) cut.push_back(8);
  cut.push_back(7);
  j.software.pipeline_layers = cut;
  Layout l{.dp = 8, .tp = 8, .pp = 16, .micro_batch = 1, .zero = 1, .sp = true, .recompute = Recompute::Full};
  ASSERT_TRUE(check_layout(l, j).ok()) << check_layout(l, j).why;
  const StepTime t = step_time(l, j);
  ASSERT_EQ(t.stage_micro_batch.size(), 16u);
  // A middle stage (8 blocks) against the first (7 blocks + the embedding, not priced for Megatron) and
  // the last (7 blocks + the head and loss).
  EXPECT_GT(t.stage_micro_batch[5], t.stage_micro_batch[0]);
  EXPECT_NEAR(t.stage_micro_batch[5], t.stage_micro_batch[6], 1e-12 * t.stage_micro_batch[5]);
  EXPECT_EQ(t.stage_micro_batch[static_cast<size_t>(t.priced_stage)],
            *std::max_element(t.stage_micro_batch.begin(), t.stage_micro_batch.end()));
  EXPECT_DOUBLE_EQ(stage_layers(l, j, 0), 7);
  EXPECT_DOUBLE_EQ(stage_layers(l, j, 3), 8);
  // A middle stage holds one block more than the first and no embedding.
  const auto pc = count_params(j.model);
  EXPECT_NEAR(stage_params_of(l, j, 3).dense - stage_params_of(l, j, 0).dense,
              static_cast<double>(pc.per_layer - pc.embedding) / 8, 1.0);
  EXPECT_TRUE(memory_per_device(l, j).fits());
  // Without a cut, 126 layers on 16 stages are cut so by default (the ends trimmed), priced alike; Loom's
  // engine, which balances by cost, still needs the blocks to divide.
  Job trimmed = j;
  trimmed.software.pipeline_layers.clear();
  ASSERT_TRUE(check_layout(l, trimmed).ok()) << check_layout(l, trimmed).why;
  EXPECT_EQ(pipeline_cut(l, trimmed), cut);
  EXPECT_DOUBLE_EQ(step_time(l, trimmed).total, t.total);
  EXPECT_DOUBLE_EQ(memory_per_device(l, trimmed).total, memory_per_device(l, j).total);
  Layout divides = l;
  divides.pp = 14;
  EXPECT_TRUE(pipeline_cut(divides, trimmed).empty());  // 126 = 14 x 9: an even split
  // The search finds Llama 3 405B's pipeline layouts on 16 stages by itself (it tried only the
  // divisors of 126 before). Interleaved chunks that do not divide the blocks are the user's to cut
  // (--pipeline-layers): stacks differ in how they cut them.
  bool sixteen = false;
  for (const auto& c : search(trimmed, Fixed{}, 100000).ranked) {
    sixteen |= c.layout.pp == 16;
    if (c.layout.pp == 16) EXPECT_EQ(c.layout.vpp, 1) << c.layout.str();
  }
  EXPECT_TRUE(sixteen);
  Layout interleaved = l;
  interleaved.vpp = 2, interleaved.schedule = Schedule::Interleaved;
  EXPECT_NE(check_layout(interleaved, trimmed).why.find("--pipeline-layers"), std::string::npos);
  // More chunks than blocks is refused naming both.
  Layout too_deep = l;
  too_deep.pp = 128, too_deep.dp = 1;
  EXPECT_NE(check_layout(too_deep, trimmed).why.find("pp * vpp = 128 chunks exceed the 126 layers"), std::string::npos)
      << check_layout(too_deep, trimmed).why;
  // Another number of chunks is another layout; a cut that does not hold the model is a job error.
  Layout eight = l;
  eight.pp = 8, eight.dp = 16;
  EXPECT_FALSE(check_layout(eight, j).ok());
  Job bad = j;
  bad.software.pipeline_layers[3] = 9;
  EXPECT_THROW(check_job(bad), ConfigError);
}
