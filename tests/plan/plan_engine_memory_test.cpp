// The planner's model of Loom's own engine against the engine itself: for tiny and mini runs under
// data parallelism and every ZeRO stage, and tensor parallelism with and without sequence parallelism,
// the predicted peak bytes per category (parameters, gradients, optimizer, activations) must be within
// 10% of what `loom train --json` measures on rank 0 (issues 6 and 12). The model mirrors the engine's
// buffers, so it is held to 1%: today it agrees to the byte.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "../cli/cli_runner.h"
#include "loom/error.h"
#include "loom/plan/engine_memory.h"
#include "loom/spec/pipeline_stages.h"
#include "loom/spec/transformer_config.h"

namespace loom::test {
namespace {

plan::EngineNumerics numerics(const std::string& precision) {
  return {precision == "bf16", precision == "bf16-pure"};
}

struct Case {
  const char* preset;
  const char* precision;
  int dp, zero, batch, micro;
  int tp = 1;
  bool sp = false;
  const char* extra = "";
};

TEST(EngineMemory, PredictsTheEnginesMeasuredPeakBytesPerCategory) {
  const Case cases[] = {
      {"tiny", "fp32", 1, 0, 8, 4},      {"tiny", "bf16", 2, 0, 8, 2},      {"tiny", "bf16", 2, 1, 8, 4},
      {"tiny", "fp32", 4, 2, 8, 1},      {"tiny", "fp32", 4, 3, 8, 2},      {"tiny", "bf16", 3, 3, 6, 2},
      {"tiny-llama", "bf16", 2, 3, 8, 2}, {"mini", "bf16", 1, 0, 2, 2},     {"mini", "bf16", 2, 3, 4, 2},
      // tensor (and sequence) parallelism, alone and under dp x ZeRO; a padded vocabulary; shared KV heads
      {"tiny", "fp32", 1, 0, 8, 4, 2},    {"tiny", "bf16", 1, 0, 8, 2, 4, true},
      {"tiny", "fp32", 2, 1, 8, 2, 2, true, " --set model.vocab_size=509"},
      {"tiny-llama", "bf16", 2, 3, 8, 2, 2, true}, {"tiny-llama", "fp32", 1, 0, 4, 2, 4, false, " --set model.n_kv_heads=1"},
      {"tiny-llama", "bf16", 1, 0, 4, 2, 4, true, " --set model.n_kv_heads=2"}, {"mini", "bf16", 1, 0, 2, 2, 2, true},
      // activation recompute, alone, under ZeRO-3 and under tp with SP
      {"tiny", "fp32", 1, 0, 8, 4, 1, false, " --set train.recompute=full"},
      {"tiny-llama", "bf16", 2, 3, 8, 2, 1, false, " --set train.recompute=selective"},
      {"tiny-llama", "bf16", 1, 0, 8, 2, 2, true, " --set train.recompute=full"},
      {"mini", "bf16", 1, 0, 2, 2, 1, false, " --set train.recompute=full"},
      // bf16-pure: bf16 weights and moments, no masters (alone, every ZeRO stage, tp with SP)
      {"tiny", "bf16-pure", 1, 0, 8, 4},  {"tiny", "bf16-pure", 2, 1, 8, 2},  {"tiny-llama", "bf16-pure", 2, 2, 8, 2},
      {"tiny", "bf16-pure", 3, 3, 6, 2},  {"tiny-llama", "bf16-pure", 1, 0, 4, 2, 2, true, " --set model.n_kv_heads=1"},
      // mixture of experts: dropless top-2, under ZeRO-3, full recompute, a shared expert on every other block
      {"tiny-moe", "fp32", 1, 0, 8, 4},   {"tiny-moe", "bf16", 2, 3, 8, 2},
      {"tiny-moe", "bf16", 1, 0, 8, 2, 1, false, " --set train.recompute=full"},
      {"tiny-moe", "fp32", 1, 0, 8, 4, 1, false,
       " --set model.moe.shared_experts=1 --set model.moe.every=2 --set train.recompute=selective"},
      {"tiny-moe", "bf16-pure", 2, 1, 8, 2, 1, false, " --set model.moe.shared_experts=1 --set model.moe.every=2"},
      // expert parallelism: each rank holds experts / ep, and the expert side rows for ep x its own
      {"tiny-moe", "fp32", 2, 0, 8, 2, 1, false, " --set parallel.ep=2"},
      {"tiny-moe", "bf16", 4, 0, 8, 2, 1, false, " --set parallel.ep=2 --set train.recompute=full"},
      // with a capacity factor the expert side holds at most every expert's capacity, whatever ep is
      {"tiny-moe", "fp32", 4, 0, 8, 2, 1, false, " --set parallel.ep=4 --set model.moe.capacity_factor=1.25"},
      // ZeRO under expert parallelism: the experts sharded over the expert replicas (2 of them; 1 at
      // ep = dp), the rest over every replica; shared experts and dense blocks between the MoE ones
      // (ZeRO-1 there: under ZeRO-2/3 blocks of different sizes make the scratch an upper bound)
      {"tiny-moe", "bf16", 4, 3, 8, 2, 1, false, " --set parallel.ep=2"},
      {"tiny-moe", "fp32", 4, 2, 8, 2, 1, false, " --set parallel.ep=2 --set model.moe.shared_experts=1"},
      {"tiny-moe", "bf16", 4, 1, 8, 2, 1, false,
       " --set parallel.ep=2 --set model.moe.shared_experts=1 --set model.moe.every=2"},
      {"tiny-moe", "bf16", 2, 1, 8, 2, 1, false, " --set parallel.ep=2"},
      {"tiny-moe", "bf16-pure", 2, 3, 8, 2, 1, false, " --set parallel.ep=2"},
      // tensor parallelism inside the experts: widths / tp, the partial sums, under SP the gathered rows
      {"tiny-moe", "bf16", 1, 0, 8, 2, 2, true, " --set model.moe.shared_experts=1"},
      {"tiny-moe", "fp32", 1, 0, 8, 4, 2, false},
      {"tiny-moe", "bf16", 2, 3, 8, 2, 2, true, " --set parallel.ep=2"},
  };
  for (const Case& c : cases) {
    auto dir = scratch_dir("engine-mem");
    const int64_t seq = 64;
    auto r = run_loom("run -n " + std::to_string(c.dp * c.tp) + " -- loom train --quiet --json --set model.preset=" + c.preset +
                      " --set precision=" + c.precision + " --set data.source=synthetic --set train.steps=2"
                      " --set train.eval_every=0 --set checkpoint.save_every=0 --set trace.summary=false"
                      " --set train.seq_len=" + std::to_string(seq) + " --set train.batch_size=" + std::to_string(c.batch) +
                      " --set train.micro_batch_size=" + std::to_string(c.micro) + " --set parallel.dp=" +
                      std::to_string(c.dp) + " --set parallel.zero=" + std::to_string(c.zero) + " --set parallel.tp=" +
                      std::to_string(c.tp) + " --set parallel.sequence_parallel=" + (c.sp ? "true" : "false") + c.extra +
                      " --set train.out_dir=" + (dir / "out").string());
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto measured = nlohmann::json::parse(r.out)["peak_bytes_by_category"];
    plan::Layout l;
    l.dp = c.dp, l.zero = c.zero, l.micro_batch = c.micro, l.tp = c.tp, l.sp = c.sp;
    auto model = spec::preset(c.preset);
    if (std::string(c.extra).find("vocab_size=509") != std::string::npos) model.vocab_size = 509;
    if (std::string(c.extra).find("n_kv_heads=1") != std::string::npos) model.n_kv_heads = 1;
    if (std::string(c.extra).find("n_kv_heads=2") != std::string::npos) model.n_kv_heads = 2;
    if (std::string(c.extra).find("moe.shared_experts=1") != std::string::npos) model.moe.shared_experts = 1;
    if (std::string(c.extra).find("parallel.ep=2") != std::string::npos) l.ep = 2;
    if (std::string(c.extra).find("parallel.ep=4") != std::string::npos) l.ep = 4;
    if (std::string(c.extra).find("capacity_factor=1.25") != std::string::npos) model.moe.capacity_factor = 1.25;
    if (std::string(c.extra).find("moe.every=2") != std::string::npos) model.moe.every = 2;
    if (std::string(c.extra).find("recompute=full") != std::string::npos) l.recompute = plan::Recompute::Full;
    if (std::string(c.extra).find("recompute=selective") != std::string::npos) l.recompute = plan::Recompute::Selective;
    const auto predicted = plan::loom_engine_memory(model, l, seq, numerics(c.precision));
    const std::pair<const char*, double> rows[] = {{"parameters", predicted.parameters},
                                                   {"gradients", predicted.gradients},
                                                   {"optimizer", predicted.optimizer},
                                                   {"activations", predicted.activations}};
    for (const auto& [category, bytes] : rows) {
      const double m = measured[category].get<double>();
      EXPECT_NEAR(bytes, m, 0.01 * m) << c.preset << " " << c.precision << " dp=" << c.dp << " zero=" << c.zero
                                      << " tp=" << c.tp << " sp=" << c.sp << c.extra
                                      << " micro=" << c.micro << ": " << category << " predicted " << bytes
                                      << ", measured " << m;
    }
  }
}

// Pipeline parallelism: each stage's rank holds its chunks (the first the embeddings, the last the head
// and its logits) and one activation context per micro-batch the schedule keeps in flight there (1F1B:
// pp - r on the first stage's ...; GPipe: all m; interleaved: per chunk), so the measured activation peak
// of every stage is the schedule's promise on memory, predicted to the byte.
struct PipeCase {
  const char* preset;
  const char* precision;
  int pp, dp, zero, tp;
  bool sp;
  const char* schedule;
  int v;
  const char* layers;  // explicit cut, or ""
  const char* recompute = "none";
  int moe_every = 1;  // mixture of experts (tiny-moe): every k-th block is MoE, the others dense
};

TEST(EngineMemory, PredictsEveryPipelineStagesPeakBytesUnderEachSchedule) {
  const PipeCase cases[] = {
      {"tiny", "fp32", 2, 1, 0, 1, false, "1f1b", 1, ""},   {"tiny", "fp32", 2, 1, 0, 1, false, "gpipe", 1, ""},
      {"tiny", "bf16", 2, 1, 0, 1, false, "interleaved-1f1b", 2, ""},
      {"tiny-llama", "bf16", 2, 1, 0, 1, false, "1f1b", 1, "1,3"},
      {"tiny", "bf16", 2, 2, 1, 1, false, "1f1b", 1, ""},  {"tiny-llama", "fp32", 2, 1, 0, 2, true, "1f1b", 1, ""},
      {"tiny", "bf16", 2, 1, 0, 2, false, "gpipe", 1, ""},  {"tiny-llama", "bf16", 2, 1, 0, 1, false, "zb-h1", 1, ""},
      {"tiny", "fp32", 2, 2, 1, 1, false, "zb-h1", 1, "3,1"},
      {"tiny", "bf16", 2, 1, 0, 1, false, "1f1b", 1, "", "full"},
      {"tiny-llama", "fp32", 2, 1, 0, 1, false, "gpipe", 1, "1,3", "selective"},
      {"tiny", "bf16", 2, 1, 0, 1, false, "interleaved-1f1b", 2, "", "full"},
      {"tiny-llama", "bf16-pure", 2, 2, 1, 1, false, "1f1b", 1, ""},
      {"tiny-moe", "bf16", 2, 1, 0, 1, false, "1f1b", 1, "1,3", "none", 2},  // a dense first stage, a mixed last
      {"tiny-moe", "fp32", 2, 1, 0, 1, false, "interleaved-1f1b", 2, "", "full", 3},
  };
  for (const PipeCase& c : cases) {
    auto dir = scratch_dir("engine-mem-pp");
    const int64_t seq = 32, micro = 2, batch = 8 * c.dp;
    auto r = run_loom("run -n " + std::to_string(c.pp * c.dp * c.tp) + " -- loom train --quiet --json --set model.preset=" +
                      c.preset + " --set model.n_layers=4 --set precision=" + c.precision +
                      " --set data.source=synthetic --set train.steps=2 --set train.eval_every=2 --set train.eval_batches=1"
                      " --set checkpoint.save_every=0 --set trace.summary=false --set train.seq_len=" + std::to_string(seq) +
                      " --set train.batch_size=" + std::to_string(batch) + " --set train.micro_batch_size=" +
                      std::to_string(micro) + " --set parallel.pp=" + std::to_string(c.pp) + " --set parallel.dp=" +
                      std::to_string(c.dp) + " --set parallel.zero=" + std::to_string(c.zero) + " --set parallel.tp=" +
                      std::to_string(c.tp) + " --set parallel.sequence_parallel=" + (c.sp ? "true" : "false") +
                      " --set parallel.pipeline.schedule=" + c.schedule + " --set parallel.pipeline.virtual_stages=" +
                      std::to_string(c.v) + (*c.layers ? std::string(" --set parallel.pipeline.layers=") + c.layers : "") +
                      " --set train.recompute=" + c.recompute + " --set model.moe.every=" + std::to_string(c.moe_every) +
                      " --set train.out_dir=" + (dir / "out").string());
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto by_rank = nlohmann::json::parse(r.out)["peak_bytes_by_rank"];
    plan::Layout l;
    l.pp = c.pp, l.dp = c.dp, l.zero = c.zero, l.tp = c.tp, l.sp = c.sp, l.micro_batch = micro, l.vpp = c.v;
    l.recompute = spec::parse_recompute(c.recompute);
    const std::string schedule = c.schedule;
    l.schedule = schedule == "gpipe"   ? plan::Schedule::GPipe
                 : schedule == "1f1b"  ? plan::Schedule::OneFOneB
                 : schedule == "zb-h1" ? plan::Schedule::ZeroBubble
                                       : plan::Schedule::Interleaved;
    auto model = spec::preset(c.preset);
    model.n_layers = 4, model.moe.every = c.moe_every;
    // Every stage, by its first rank (the mesh is (pp, dp, cp, tp), tp fastest).
    for (int stage = 0; stage < c.pp; ++stage) {
      const auto predicted = plan::loom_engine_memory(model, l, seq, numerics(c.precision),
                                                      {batch / (c.dp * micro), spec::parse_layer_counts(c.layers, "layers")},
                                                      stage);
      const auto& measured = by_rank[static_cast<size_t>(stage * c.dp * c.tp)];
      const std::pair<const char*, double> rows[] = {{"parameters", predicted.parameters},
                                                     {"gradients", predicted.gradients},
                                                     {"optimizer", predicted.optimizer},
                                                     {"activations", predicted.activations}};
      for (const auto& [category, bytes] : rows)
        EXPECT_EQ(bytes, measured[category].get<double>())
            << c.preset << " " << c.precision << " pp=" << c.pp << " dp=" << c.dp << " zero=" << c.zero << " tp=" << c.tp
            << " sp=" << c.sp << " " << c.schedule << " v=" << c.v << " layers=" << c.layers << " stage " << stage
            << ": " << category;
    }
  }
}

// Context parallelism (issue 20 item 5): each rank's contexts hold seq / cp tokens of every sample, the
// rank keeps the whole samples it loads and the attention's scratch (ring or all-to-all), and ZeRO
// shards over dp x cp; predicted to the byte for rank 0.
TEST(EngineMemory, PredictsContextParallelRanksPeakBytes) {
  struct CpCase {
    const char* preset;
    const char* precision;
    int cp, dp, zero, tp;
    bool a2a, sp = false;
    const char* extra = "";
  };
  const CpCase cases[] = {
      {"tiny", "fp32", 2, 1, 0, 1, false},
      {"tiny", "bf16", 2, 1, 0, 1, true},
      {"tiny-llama", "fp32", 4, 1, 0, 1, false},
      {"tiny-llama", "bf16", 2, 2, 3, 1, false},
      {"tiny", "fp32", 2, 1, 0, 2, false, true},
      {"tiny-llama", "bf16-pure", 2, 1, 0, 1, true},
      {"tiny-llama", "fp32", 2, 1, 0, 1, false, false, " --set train.recompute=selective"},
  };
  for (const CpCase& c : cases) {
    auto dir = scratch_dir("engine-mem-cp");
    const int64_t seq = 64;
    auto r = run_loom("run -n " + std::to_string(c.cp * c.dp * c.tp) + " -- loom train --quiet --json --set model.preset=" +
                      c.preset + " --set precision=" + c.precision + " --set data.source=synthetic --set train.steps=2"
                      " --set train.eval_every=0 --set checkpoint.save_every=0 --set trace.summary=false"
                      " --set train.seq_len=64 --set train.batch_size=4 --set train.micro_batch_size=2"
                      " --set parallel.cp=" + std::to_string(c.cp) + " --set parallel.cp_mode=" +
                      (c.a2a ? "all-to-all" : "ring") + " --set parallel.dp=" + std::to_string(c.dp) +
                      " --set parallel.zero=" + std::to_string(c.zero) + " --set parallel.tp=" + std::to_string(c.tp) +
                      " --set parallel.sequence_parallel=" + (c.sp ? "true" : "false") + c.extra +
                      " --set train.out_dir=" + (dir / "out").string());
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto measured = nlohmann::json::parse(r.out)["peak_bytes_by_category"];
    plan::Layout l;
    l.cp = c.cp, l.dp = c.dp, l.zero = c.zero, l.tp = c.tp, l.sp = c.sp, l.micro_batch = 2, l.cp_all_to_all = c.a2a;
    if (std::string(c.extra).find("selective") != std::string::npos) l.recompute = plan::Recompute::Selective;
    const auto predicted = plan::loom_engine_memory(spec::preset(c.preset), l, seq, numerics(c.precision));
    const std::pair<const char*, double> rows[] = {{"parameters", predicted.parameters},
                                                   {"gradients", predicted.gradients},
                                                   {"optimizer", predicted.optimizer},
                                                   {"activations", predicted.activations}};
    for (const auto& [category, bytes] : rows) {
      const double m = measured[category].get<double>();
      EXPECT_NEAR(bytes, m, 0.01 * m) << c.preset << " " << c.precision << " cp=" << c.cp << (c.a2a ? " a2a" : " ring")
                                      << " dp=" << c.dp << " zero=" << c.zero << " tp=" << c.tp << c.extra << ": "
                                      << category << " predicted " << bytes << ", measured " << m;
    }
  }
}

TEST(EngineMemory, RefusesLayoutsTheEngineDoesNotRun) {
  plan::Layout l;
  l.ep = 2;
  EXPECT_THROW(plan::loom_engine_memory(spec::preset("tiny"), l, 64, false), ConfigError);
  l.ep = 1, l.cp = 3;  // 64 tokens do not split into 6 chunks
  EXPECT_THROW(plan::loom_engine_memory(spec::preset("tiny"), l, 64, false), ConfigError);
  l.cp = 1, l.pp = 2, l.dp = 2, l.zero = 2;
  EXPECT_THROW(plan::loom_engine_memory(spec::preset("tiny"), l, 64, false, {4, {}}), ConfigError);
  l.dp = 1, l.zero = 0, l.schedule = plan::Schedule::ZeroBubble, l.recompute = plan::Recompute::Full;
  EXPECT_THROW(plan::loom_engine_memory(spec::preset("tiny"), l, 64, false, {4, {}}), ConfigError);
}

}  // namespace
}  // namespace loom::test
