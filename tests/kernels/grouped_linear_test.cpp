// The backend's grouped linear (mixture-of-experts experts): every group's rows through its own weight,
// forward and backward, against a float64 loop over the groups -- with empty groups, f32 and bf16, and
// row counts that change from call to call (one run-time-shaped primitive serves them all).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "loom/core/bf16.h"
#include "loom/kernels/cpu_backend.h"

using namespace loom;

namespace {

struct Case {
  DType dtype;
  std::vector<int64_t> rows;  // per group
};

void check(const Case& cs, uint32_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " dtype " + std::string(dtype_name(cs.dtype)));
  const int64_t IC = 24, OC = 40, G = static_cast<int64_t>(cs.rows.size());
  std::vector<int64_t> offsets{0};
  for (int64_t r : cs.rows) offsets.push_back(offsets.back() + r);
  const int64_t M = offsets.back();
  Allocator alloc;
  kernels::CpuBackend be(alloc, nullptr, 2);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  const bool lowp = cs.dtype == DType::BF16;
  // Values representable in the operand dtype, so float64 sees exactly what the GEMMs see.
  auto fill = [&](const Tensor& t) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = dist(rng);
      if (t.dtype() == DType::BF16)
        t.data<bf16>()[i] = f32_to_bf16(v);
      else
        t.data<float>()[i] = t.dtype() == DType::F32 && lowp ? round_to_bf16(v) : v;
    }
  };
  auto at = [](const Tensor& t, int64_t i) {
    return t.dtype() == DType::BF16 ? static_cast<double>(bf16_to_f32(t.data<bf16>()[i])) : t.data<float>()[i];
  };
  auto make = [&](Shape s, DType d) { return Tensor::empty(s, d, alloc, MemCategory::Workspace); };
  Tensor x = make({M + 3, IC}, cs.dtype), y = make({M + 3, OC}, DType::F32), dy = make({M + 3, OC}, DType::F32);
  Tensor dx = make({M + 3, IC}, DType::F32);
  fill(x), fill(dy);
  std::vector<Tensor> w, dw;
  for (int64_t g = 0; g < G; ++g) {
    w.push_back(make({OC, IC}, cs.dtype)), dw.push_back(make({OC, IC}, DType::F32));
    fill(w.back()), fill(dw.back());
  }
  std::vector<std::vector<float>> dw0;
  for (auto& t : dw) dw0.emplace_back(t.data<float>(), t.data<float>() + t.numel());
  be.grouped_linear_forward(y, x, w, offsets);
  be.grouped_linear_backward(dx, dw, dy, x, w, offsets);
  // bf16 weights take dy rounded to bf16 (as every bf16 linear does).
  auto dy_at = [&](int64_t i) { return lowp ? static_cast<double>(round_to_bf16(dy.data<float>()[i])) : dy.data<float>()[i]; };
  const double tol = 1e-4;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      for (int64_t o = 0; o < OC; ++o) {
        double want = 0;
        for (int64_t i = 0; i < IC; ++i) want += at(x, r * IC + i) * at(w[g], o * IC + i);
        ASSERT_NEAR(y.data<float>()[r * OC + o], want, tol * (1 + std::abs(want))) << "y row " << r << " group " << g;
      }
      for (int64_t i = 0; i < IC; ++i) {
        double want = 0;
        for (int64_t o = 0; o < OC; ++o) want += dy_at(r * OC + o) * at(w[g], o * IC + i);
        ASSERT_NEAR(dx.data<float>()[r * IC + i], want, tol * (1 + std::abs(want))) << "dx row " << r;
      }
    }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t i = 0; i < IC; ++i) {
        double want = dw0[g][o * IC + i];
        for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) want += dy_at(r * OC + o) * at(x, r * IC + i);
        ASSERT_NEAR(dw[g].data<float>()[o * IC + i], want, tol * (1 + std::abs(want))) << "dw group " << g;
      }
}

}  // namespace

TEST(GroupedLinear, EveryGroupMatchesFloat64ForwardAndBackwardIncludingEmptyGroups) {
  uint32_t seed = 7;
  for (DType d : {DType::F32, DType::BF16}) {
    check({d, {5, 0, 17, 1}}, seed++);
    check({d, {0, 0, 33}}, seed++);
    check({d, {64, 3, 0, 9, 12}}, seed++);  // the same primitive, other counts
  }
}
