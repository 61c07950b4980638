// The planner's `--engine loom` memory-bound class is priced from the bytes Loom's own element-wise
// kernels move (plan/engine_stream_bytes.h). Those bytes must be the ones the kernels declare in their
// trace spans: traced tiny runs (GPT-2 and Llama style, mixture of experts, fp32 and bf16, one rank and
// tensor parallelism with and without SP and overlap, replicated KV heads) are read back and every kernel that is neither
// a GEMM nor attention is summed per step and rank, and compared with the model.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <nlohmann/json.hpp>

#include "../cli/cli_runner.h"
#include "loom/plan/engine_stream_bytes.h"
#include "loom/plan/hardware.h"
#include "loom/plan/model_zoo.h"
#include "loom/plan/time_model.h"
#include "loom/spec/param_table.h"
#include "loom/spec/transformer_config.h"

namespace loom::test {
namespace {

struct Case {
  const char* preset;
  const char* precision;
  int tp = 1;
  bool sp = false, overlap = true;
  int kv_heads = 0;  // 0: the preset's
  const char* recompute = "none";
};

TEST(EngineStreamBytes, AreTheBytesTheEnginesKernelsDeclare) {
  const Case cases[] = {
      {"tiny", "bf16"},
      {"tiny", "fp32"},
      {"tiny-llama", "bf16"},
      {"tiny", "bf16", 2, false, true},
      {"tiny", "bf16", 2, false, false},
      {"tiny", "fp32", 2, true},
      {"tiny-llama", "bf16", 2, true},
      {"tiny-llama", "bf16", 4, false, true, 1},
      // what recompute runs again
      {"tiny", "bf16", 1, false, true, 0, "full"},
      {"tiny-llama", "fp32", 1, false, true, 0, "full"},
      {"tiny-llama", "bf16", 2, true, true, 0, "full"},
      {"tiny", "bf16", 1, false, true, 0, "selective"},
      // mixture of experts: routing, dispatch, the experts' SwiGLU on N k rows, combine; under tp the
      // gathered rows and the partial sums
      {"tiny-moe", "bf16"},
      {"tiny-moe", "fp32"},
      {"tiny-moe", "bf16", 2, true},
      {"tiny-moe", "fp32", 2, false},
      {"tiny-moe", "bf16", 1, false, true, 0, "full"},
  };
  const int64_t seq = 32, batch = 4, micro = 2;
  for (const Case& c : cases) {
    auto dir = scratch_dir("engine-bytes");
    const std::string out = (dir / "out").string();
    const std::string kv = c.kv_heads ? " --set model.n_kv_heads=" + std::to_string(c.kv_heads) : "";
    auto r = run_loom("run -n " + std::to_string(c.tp) + " -- loom train --quiet --set model.preset=" + c.preset +
                      " --set precision=" + c.precision + kv +
                      " --set data.source=synthetic --set train.steps=4 --set train.eval_every=0"
                      " --set checkpoint.save_every=0 --set trace.summary=false --set train.seq_len=" +
                      std::to_string(seq) + " --set train.batch_size=" + std::to_string(batch) +
                      " --set train.micro_batch_size=" + std::to_string(micro) +
                      " --set parallel.tp=" + std::to_string(c.tp) + " --set parallel.sequence_parallel=" +
                      (c.sp ? "true" : "false") + " --set parallel.tp_overlap=" + (c.overlap ? "true" : "false") +
                      " --set train.recompute=" + c.recompute + " --set train.out_dir=" + out +
                      " --set trace.file=" + out + "/trace.json");
    ASSERT_EQ(r.rc, 0) << r.err;
    r = run_loom("profile report " + out + " --json --peak-flops 1e11 --bandwidth 1e10");
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto report = nlohmann::json::parse(r.out);
    double measured = 0;  // per step and rank
    std::string names;
    for (const auto& k : report["kernels"]) {
      const std::string name = k["name"];
      if (name.rfind("gemm", 0) == 0 || name.rfind("attention", 0) == 0) continue;
      measured += k["bytes"].get<double>();
      names += " " + name;
    }

    auto model = spec::preset(c.preset);
    if (c.kv_heads) model.n_kv_heads = c.kv_heads;
    plan::Layout l;
    l.tp = c.tp, l.sp = c.sp, l.micro_batch = static_cast<int>(micro);
    l.recompute = spec::parse_recompute(c.recompute);
    const bool bf16 = std::string(c.precision) == "bf16";
    const auto b = plan::engine_stream_bytes(model, l, seq, bf16);
    const double local_params =
        static_cast<double>(spec::build_param_table(model, spec::TableShard{0, c.tp}).total_numel());
    const double micro_batches = static_cast<double>(batch / micro);
    const double predicted = micro_batches * (static_cast<double>(model.n_layers) * b.per_block + b.first_stage +
                                              b.last_stage) +
                             local_params * b.per_local_parameter;
    EXPECT_NEAR(predicted, measured, 0.01 * measured)
        << c.preset << " " << c.precision << " tp=" << c.tp << " sp=" << c.sp << " overlap=" << c.overlap
        << " kv_heads=" << model.n_kv_heads << " recompute=" << c.recompute << ": predicted " << predicted << " bytes per step, the kernels declare "
        << measured << " (" << names << " )";
    std::filesystem::remove_all(dir);
  }
}

// Loom's engine cuts pipeline stages unevenly (by declared cost, or as parallel.pipeline.layers says);
// the slowest stage waits, in warm-up and cool-down, for the other stages' passes of a micro-batch, so
// its bubble is their time (plus the hops), not (p - 1) of its own, and /v under interleaving.
TEST(EngineTime, TheSlowestStagesBubbleIsTheOtherStagesTime) {
  struct Case {
    int pp, vpp;
    std::vector<int64_t> layers;
  };
  for (const Case& c : {Case{2, 1, {5, 1}}, Case{2, 1, {1, 5}}, Case{2, 1, {}}, Case{3, 1, {}}, Case{2, 2, {}}}) {
    plan::Job j;
    j.model = plan::plan_model("mini");
    j.cluster = plan::resolve_cluster("h100:8", {LOOM_SOURCE_DIR "/configs/hardware"});
    j.seq = 256, j.global_batch = 8;
    j.software.loom_engine = true;
    j.software.pipeline_layers = c.layers;
    plan::Layout l;
    l.pp = c.pp, l.vpp = c.vpp, l.micro_batch = 2;
    l.schedule = c.vpp > 1 ? plan::Schedule::Interleaved : plan::Schedule::OneFOneB;
    const auto st = plan::step_time(l, j);
    ASSERT_EQ(st.stage_micro_batch.size(), static_cast<size_t>(c.pp));
    const double slowest = *std::max_element(st.stage_micro_batch.begin(), st.stage_micro_batch.end());
    const double others = std::accumulate(st.stage_micro_batch.begin(), st.stage_micro_batch.end(), 0.0) - slowest;
    const double m = 8.0 / 2, p2p = st.pp / m;
    EXPECT_NEAR(st.bubble, (others + (c.pp - 1) * p2p) / c.vpp, 1e-12 * st.total) << c.pp << " " << c.vpp;
    EXPECT_LT(st.bubble, (c.pp - 1.0) / c.vpp * (slowest + p2p) + 1e-15) << "never more than the even-stage bubble";
    EXPECT_EQ(st.stage_micro_batch[static_cast<size_t>(st.priced_stage)], slowest);
  }
}

}  // namespace
}  // namespace loom::test
