// Context-parallel attention against the whole sequence on one rank (issue 20 items 1 and 2): every rank
// of a `loom run -n cp` job draws the same full-length qkv and output gradient, runs the single-rank
// attention over all T tokens as the reference, then the cp-group op on its own tokens
// (spec::context_positions), and checks its rows of out, the softmax statistics and dqkv against the
// reference's, over shapes the CLI runs do not reach: cp = 2, 3, 4, several samples, grouped-query and
// multi-query heads, a chunk of one token, both modes. The worker is this binary itself, started by the
// launcher with LOOM_CP_TEST_CASE set.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../cli/cli_runner.h"
#include "loom/comm/job_env.h"
#include "loom/comm/world.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/parallel/context_parallel_attention.h"
#include "loom/spec/context_parallel.h"

namespace loom::test {
namespace {

struct Case {
  int64_t B, T, H, KVH, D;
  const char* mode;
};

// The worker: runs on every rank of the job; returns the number of mismatches (0 passes).
int run_worker(const Case& c) {
  auto world = comm::World::join(comm::read_job_env(), comm::comm_options_from_env(comm::current_environment()));
  comm::ProcessGroup& group = world->group();
  const int cp = group.size(), rank = group.rank();
  Allocator alloc;
  kernels::CpuBackend be{alloc, nullptr, 1};
  const int64_t W = (c.H + 2 * c.KVH) * c.D, HD = c.H * c.D, Tl = c.T / cp;
  const kernels::AttentionShape whole{c.B, c.T, c.H, c.KVH, c.D, 1.0f / std::sqrt(static_cast<float>(c.D)), false};
  std::mt19937 gen(20261206);  // the same draw on every rank
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto draw = [&](const Shape& shape) {
    Tensor t = Tensor::empty(shape, DType::F32, alloc, MemCategory::Workspace);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = normal(gen);
    return t;
  };
  const Tensor qkv = draw({c.B, c.T, W}), dout = draw({c.B, c.T, HD});
  auto zeros = [&](const Shape& shape) {
    Tensor t = Tensor::empty(shape, DType::F32, alloc, MemCategory::Workspace);
    t.fill_zero();
    return t;
  };
  const Tensor out = zeros({c.B, c.T, HD}), lse = zeros({c.B, c.H, c.T}), dqkv = zeros({c.B, c.T, W});
  Tensor qkv_ref = zeros({c.B, c.T, W});
  std::copy(qkv.data<float>(), qkv.data<float>() + qkv.numel(), qkv_ref.data<float>());
  be.attention_forward(out, lse, qkv_ref, whole);
  be.attention_backward(dqkv, dout, out, lse, qkv_ref, whole);

  // This rank's rows of each sample.
  const auto pos = spec::context_positions(c.T, cp, rank);
  auto mine = [&](const Tensor& full, int64_t width) {
    Tensor t = zeros({c.B, Tl, width});
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t_ = 0; t_ < Tl; ++t_)
        std::copy_n(full.data<float>() + (b * c.T + pos[static_cast<size_t>(t_)]) * width, width,
                    t.data<float>() + (b * Tl + t_) * width);
    return t;
  };
  const Tensor q_local = mine(qkv, W), dout_local = mine(dout, HD);
  const Tensor out_l = zeros({c.B, Tl, HD}), lse_l = zeros({c.B, c.H, Tl}), dqkv_l = zeros({c.B, Tl, W});
  parallel::ContextParallelAttention op(be, group, spec::parse_cp_mode(c.mode));
  kernels::AttentionShape s = whole;
  s.T = Tl;
  op.forward(out_l, lse_l, q_local, s);
  // Twice, as selective recompute runs it again before backward: the second must give the same bits.
  std::vector<float> first(out_l.data<float>(), out_l.data<float>() + out_l.numel());
  op.recompute(out_l, lse_l, q_local, s);
  op.backward(dqkv_l, dout_local, out_l, lse_l, q_local, s);

  int bad = 0;
  auto check = [&](const char* what, float got, float want, double tol) {
    if (std::abs(got - want) <= tol * (1.0 + std::abs(want))) return;
    if (bad++ < 8) std::fprintf(stderr, "rank %d: %s = %.7g, whole sequence %.7g\n", rank, what, got, want);
  };
  for (int64_t i = 0; i < out_l.numel(); ++i)
    if (out_l.data<float>()[i] != first[static_cast<size_t>(i)]) {
      if (bad++ < 8) std::fprintf(stderr, "rank %d: recompute changed out[%lld]\n", rank, static_cast<long long>(i));
    }
  const Tensor out_want = mine(out, HD), dqkv_want = mine(dqkv, W);
  for (int64_t i = 0; i < out_l.numel(); ++i) check("out", out_l.data<float>()[i], out_want.data<float>()[i], 2e-5);
  for (int64_t i = 0; i < dqkv_l.numel(); ++i)
    check("dqkv", dqkv_l.data<float>()[i], dqkv_want.data<float>()[i], 5e-5);
  if (std::string(c.mode) == "ring")  // all-to-all keeps its statistics head-sharded, for its own backward
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t t = 0; t < Tl; ++t)
          check("lse", lse_l.data<float>()[(b * c.H + h) * Tl + t],
                lse.data<float>()[(b * c.H + h) * c.T + pos[static_cast<size_t>(t)]], 2e-6);
  return bad;
}

TEST(ContextParallelAttentionWorker, OneRank) {
  const char* spec = std::getenv("LOOM_CP_TEST_CASE");
  if (!spec) GTEST_SKIP() << "a rank of the jobs below (LOOM_CP_TEST_CASE unset)";
  Case c{};
  char mode[32] = {};
  ASSERT_EQ(std::sscanf(spec, "%ld,%ld,%ld,%ld,%ld,%31s", &c.B, &c.T, &c.H, &c.KVH, &c.D, mode), 6) << spec;
  c.mode = mode;
  EXPECT_EQ(run_worker(c), 0);
}

TEST(ContextParallelAttention, EveryRankMatchesTheWholeSequence) {
  struct Job {
    int cp;
    Case c;
  };
  const Job jobs[] = {
      {2, {1, 16, 2, 2, 8, "ring"}},       {2, {3, 24, 4, 2, 16, "ring"}},     {3, {2, 36, 3, 1, 8, "ring"}},
      {4, {2, 64, 4, 2, 8, "ring"}},       {4, {1, 8, 2, 1, 4, "ring"}},       {2, {2, 40, 4, 2, 8, "all-to-all"}},
      {4, {1, 32, 8, 4, 8, "all-to-all"}}, {3, {2, 30, 6, 3, 4, "all-to-all"}},
  };
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (const Job& j : jobs) {
    const Case& c = j.c;
    const std::string spec = std::to_string(c.B) + "," + std::to_string(c.T) + "," + std::to_string(c.H) + "," +
                             std::to_string(c.KVH) + "," + std::to_string(c.D) + "," + c.mode;
    SCOPED_TRACE("cp=" + std::to_string(j.cp) + " B,T,H,KVH,D,mode = " + spec);
    auto r = run_shell("LOOM_CP_TEST_CASE=" + spec + " " + LOOM_BINARY + " run -n " + std::to_string(j.cp) + " -- " +
                       self + " --gtest_filter=ContextParallelAttentionWorker.OneRank");
    EXPECT_EQ(r.rc, 0) << r.out << r.err;
    EXPECT_THAT(r.out, ::testing::Not(::testing::HasSubstr("SKIPPED")));
    int passed = 0;  // every rank ran the worker and passed
    for (size_t at = r.out.find("[  PASSED  ] 1 test"); at != std::string::npos;
         at = r.out.find("[  PASSED  ] 1 test", at + 1))
      ++passed;
    EXPECT_EQ(passed, j.cp) << r.out;
  }
}

}  // namespace
}  // namespace loom::test
