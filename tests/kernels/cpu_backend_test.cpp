// The CPU backend's linear backward: the bias gradient taken in the pass that casts dY to bf16 is the
// column sum of dY (float64 reference), and a backward split in two calls through prepare_output_grad
// (what tensor parallelism does to run the weight gradient under the input gradient's collective)
// gives exactly what the whole call gives, in bf16 and in f32, and traces one cast of dY, not two.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/core/tensor.h"
#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/elementwise.h"
#include "loom/profile/tracer.h"

namespace loom::kernels {
namespace {

struct Linear {
  Tensor x, w, dy;
};

Linear make_linear(DType dtype, int64_t N, int64_t IC, int64_t OC, Allocator& alloc) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto filled = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& f : v) f = dist(rng);
    return v;
  };
  auto as = [&](const std::vector<float>& v, const Shape& shape, DType dt) {
    Tensor t = Tensor::empty(shape, dt, alloc, MemCategory::Workspace);
    if (dt == DType::BF16)
      cast_f32_to_bf16(t.data<bf16>(), v.data(), static_cast<int64_t>(v.size()));
    else
      std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
    return t;
  };
  return {as(filled(N * IC), {N, IC}, dtype), as(filled(OC * IC), {OC, IC}, dtype),
          as(filled(N * OC), {N, OC}, DType::F32)};
}

bool same(const Tensor& a, const Tensor& b) { return std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0; }

TEST(CpuBackend, ASplitBackwardGivesTheWholeBackwardAndCastsDyOnce) {
  Allocator alloc;
  profile::Tracer tracer(profile::Tracer::Mode::Summary);
  CpuBackend be(alloc, &tracer, 2);
  const int64_t N = 96, IC = 48, OC = 80;
  for (DType dtype : {DType::BF16, DType::F32}) {
    SCOPED_TRACE(dtype == DType::BF16 ? "bf16" : "f32");
    const Linear l = make_linear(dtype, N, IC, OC, alloc);
    auto zeros = [&](const Shape& s) { return Tensor::zeros(s, DType::F32, alloc, MemCategory::Workspace); };
    Tensor dx1 = zeros({N, IC}), dw1 = zeros({OC, IC}), db1 = zeros({OC});
    be.linear_backward(&dx1, false, dw1, &db1, l.dy, l.x, l.w);
    // The bias gradient is dY's column sums, whichever pass took them.
    for (int64_t j = 0; j < OC; ++j) {
      double want = 0;
      for (int64_t n = 0; n < N; ++n) want += l.dy.data<float>()[n * OC + j];
      EXPECT_NEAR(db1.data<float>()[j], want, 1e-4 * (1 + std::abs(want))) << j;
    }
    tracer.reset_stats();
    Tensor dx2 = zeros({N, IC}), dw2 = zeros({OC, IC}), db2 = zeros({OC});
    const Tensor g = be.prepare_output_grad(l.dy, &db2, l.w);
    EXPECT_EQ(g.dtype(), dtype);
    be.linear_backward(&dx2, false, Tensor(), nullptr, g, l.x, l.w);
    be.linear_backward(nullptr, false, dw2, nullptr, g, l.x, l.w);
    EXPECT_TRUE(same(dx1, dx2));
    EXPECT_TRUE(same(dw1, dw2));
    EXPECT_TRUE(same(db1, db2));
    const auto stats = tracer.stats();
    if (dtype == DType::BF16) {
      ASSERT_TRUE(stats.count("cast_dy_bf16"));
      EXPECT_EQ(stats.at("cast_dy_bf16").calls, 1);
      EXPECT_EQ(stats.count("bias_bwd"), 0u) << "the bias gradient rides on the cast";
    } else {
      EXPECT_EQ(stats.count("cast_dy_bf16"), 0u);
      EXPECT_EQ(stats.at("bias_bwd").calls, 1);
    }
  }
}

TEST(CpuBackend, ABf16DyWithABiasGradientIsRefused) {
  Allocator alloc;
  CpuBackend be(alloc, nullptr, 1);
  const Linear l = make_linear(DType::BF16, 8, 16, 8, alloc);
  Tensor dw = Tensor::zeros({8, 16}, DType::F32, alloc, MemCategory::Workspace);
  Tensor db = Tensor::zeros({8}, DType::F32, alloc, MemCategory::Workspace);
  const Tensor g = be.prepare_output_grad(l.dy, nullptr, l.w);
  EXPECT_THROW(be.linear_backward(nullptr, false, dw, &db, g, l.x, l.w), loom::Error);
}

}  // namespace
}  // namespace loom::kernels
