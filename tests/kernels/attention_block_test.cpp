// Attention blocks without a mask (queries against another buffer's keys and values: context
// parallelism's ring) on every path -- f32 and bf16 dot products -- against a float64 implementation
// written here, and the identity the ring rests on: blocks merged by their log-sum-exp equal one
// attention over all keys.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../test_support.h"
#include "loom/error.h"
#include "loom/kernels/attention.h"

namespace loom::kernels {
namespace {

struct BlockShape {
  AttentionShape s;  // s.T = queries
  int64_t Tk;
};

BlockShape block(int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t KVH, int64_t D) {
  return {{B, Tq, H, KVH, D, 1.0f / std::sqrt(static_cast<float>(D)), false}, Tk};
}

std::string describe(const BlockShape& b) {
  const auto& s = b.s;
  return "B=" + std::to_string(s.B) + " Tq=" + std::to_string(s.T) + " Tk=" + std::to_string(b.Tk) +
         " H=" + std::to_string(s.H) + " KVH=" + std::to_string(s.KVH) + " D=" + std::to_string(s.D);
}

std::vector<float> random_vector(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct Reference {
  std::vector<double> out, lse, dq, dkv;
};

// Float64, straight from the definitions: S = scale q k^T over all Tk keys, P = softmax(S), out = P v;
// backward with D = dO . out, dS = P (dO v^T - D).
Reference reference(const BlockShape& bs, const std::vector<float>& q, const std::vector<float>& kv,
                    const std::vector<float>& dout) {
  const auto& s = bs.s;
  const int64_t B = s.B, T = s.T, Tk = bs.Tk, H = s.H, KVH = s.KVH, D = s.D, group = H / KVH;
  const int64_t q_row = H * D, kv_row = 2 * KVH * D;
  Reference r;
  r.out.assign(static_cast<size_t>(B * T * q_row), 0.0);
  r.lse.assign(static_cast<size_t>(B * H * T), 0.0);
  r.dq.assign(r.out.size(), 0.0);
  r.dkv.assign(static_cast<size_t>(B * Tk * kv_row), 0.0);
  std::vector<double> p(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      for (int64_t t = 0; t < T; ++t) {
        const float* qr = &q[static_cast<size_t>((b * T + t) * q_row + h * D)];
        double m = -1e300;
        for (int64_t k = 0; k < Tk; ++k) {
          const float* kr = &kv[static_cast<size_t>((b * Tk + k) * kv_row + g * D)];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(qr[d]) * kr[d];
          p[static_cast<size_t>(k)] = dot * s.scale;
          m = std::max(m, p[static_cast<size_t>(k)]);
        }
        double l = 0;
        for (auto& x : p) l += (x = std::exp(x - m));
        r.lse[static_cast<size_t>((b * H + h) * T + t)] = m + std::log(l);
        double* o = &r.out[static_cast<size_t>((b * T + t) * q_row + h * D)];
        for (int64_t k = 0; k < Tk; ++k) {
          p[static_cast<size_t>(k)] /= l;
          const float* vr = &kv[static_cast<size_t>((b * Tk + k) * kv_row + (KVH + g) * D)];
          for (int64_t d = 0; d < D; ++d) o[d] += p[static_cast<size_t>(k)] * vr[d];
        }
        const float* dor = &dout[static_cast<size_t>((b * T + t) * q_row + h * D)];
        double Di = 0;
        for (int64_t d = 0; d < D; ++d) Di += double(dor[d]) * o[d];
        for (int64_t k = 0; k < Tk; ++k) {
          const size_t krow = static_cast<size_t>((b * Tk + k) * kv_row);
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += double(dor[d]) * kv[krow + static_cast<size_t>((KVH + g) * D + d)];
          const double ds = p[static_cast<size_t>(k)] * (dp - Di) * s.scale;
          for (int64_t d = 0; d < D; ++d) {
            r.dq[static_cast<size_t>((b * T + t) * q_row + h * D + d)] += ds * kv[krow + static_cast<size_t>(g * D + d)];
            r.dkv[krow + static_cast<size_t>(g * D + d)] += ds * qr[d];
            r.dkv[krow + static_cast<size_t>((KVH + g) * D + d)] += p[static_cast<size_t>(k)] * dor[d];
          }
        }
      }
    }
  return r;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol, const std::string& what,
                  double floor = 1e-2) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double ss = 0;
  for (double w : want) ss += w * w;
  // A floor for tensors that are zero in exact arithmetic (dq with a single key).
  const double rms = std::max(floor, std::sqrt(ss / static_cast<double>(std::max<size_t>(1, want.size()))));
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]) / (std::abs(want[i]) + rms);
    if (!(err <= worst)) worst = err, at = i;
  }
  EXPECT_LE(worst, rtol) << what << ": worst at " << at << " got " << got[at] << " want " << want[at];
}

// Off the 64-tile grid on both sides, blocks shorter and longer than the queries, D off the vector
// width, GQA groups of 1, 2 and 3.
std::vector<BlockShape> shapes() {
  return {block(1, 1, 1, 1, 1, 16),   block(2, 7, 5, 2, 2, 16),    block(1, 64, 128, 2, 1, 64),
          block(1, 65, 130, 3, 3, 24), block(2, 130, 63, 6, 2, 64), block(1, 32, 200, 4, 2, 8),
          block(1, 100, 100, 3, 1, 80)};
}

std::vector<AttentionPath> f32_paths() {
  std::vector<AttentionPath> p;
  for (auto path : {AttentionPath::F32Sse2, AttentionPath::F32Avx2, AttentionPath::F32Avx512})
    if (attention_path_supported(path)) p.push_back(path);
  return p;
}

// Rounds to bf16 (nearest even) in place: inputs a bf16 path sees exactly.
void round_to_bf16(std::vector<float>& v) {
  for (float& x : v) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    std::memcpy(&x, &u, 4);
  }
}

TEST(AttentionBlock, EveryF32PathMatchesFloat64) {
  Allocator alloc;
  std::mt19937 rng(7);
  for (const auto& bs : shapes()) {
    const auto& s = bs.s;
    const auto q = random_vector(static_cast<size_t>(s.B * s.T * s.H * s.D), rng);
    const auto kv = random_vector(static_cast<size_t>(s.B * bs.Tk * 2 * s.KVH * s.D), rng);
    const auto dout = random_vector(q.size(), rng);
    const Reference want = reference(bs, q, kv, dout);
    for (const AttentionPath path : f32_paths()) {
      const std::string what = describe(bs) + " " + attention_path_name(path);
      std::vector<float> out(q.size()), lse(static_cast<size_t>(s.B * s.H * s.T)), dq(q.size(), NAN), dkv(kv.size(), NAN);
      attention_block_forward(out.data(), lse.data(), q.data(), kv.data(), bs.Tk, s, alloc, path);
      expect_close(out, want.out, 2e-5, what + " out");
      expect_close(lse, want.lse, 2e-6, what + " lse");
      attention_block_backward(dq.data(), dkv.data(), dout.data(), out.data(), lse.data(), q.data(), kv.data(), bs.Tk,
                               s, alloc, path);
      expect_close(dq, want.dq, 5e-5, what + " dq");
      expect_close(dkv, want.dkv, 5e-5, what + " dkv");
    }
  }
}

// What ring attention computes: a query's attention over keys split in two blocks equals the blocks'
// outputs weighted by exp(lse_block - lse_all), with lse_all = log(exp(lse_1) + exp(lse_2)); and the
// backward of each block, given the merged out and lse, gives that block's share of the gradients.
TEST(AttentionBlock, BlocksMergedByLogSumExpEqualOneBlock) {
  Allocator alloc;
  std::mt19937 rng(11);
  const BlockShape all = block(2, 70, 150, 4, 2, 32);
  const auto& s = all.s;
  const int64_t T1 = 90, T2 = all.Tk - T1, kv_row = 2 * s.KVH * s.D, q_row = s.H * s.D;
  const auto q = random_vector(static_cast<size_t>(s.B * s.T * q_row), rng);
  const auto kv = random_vector(static_cast<size_t>(s.B * all.Tk * kv_row), rng);
  const auto dout = random_vector(q.size(), rng);
  // The two blocks as separate buffers: key rows [0, T1) and [T1, Tk) of each batch row.
  std::vector<float> kv1, kv2;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t k = 0; k < all.Tk; ++k) {
      auto& dst = k < T1 ? kv1 : kv2;
      const float* row = &kv[static_cast<size_t>((b * all.Tk + k) * kv_row)];
      dst.insert(dst.end(), row, row + kv_row);
    }
  const size_t nlse = static_cast<size_t>(s.B * s.H * s.T);
  std::vector<float> o1(q.size()), o2(q.size()), l1(nlse), l2(nlse);
  attention_block_forward(o1.data(), l1.data(), q.data(), kv1.data(), T1, s, alloc);
  attention_block_forward(o2.data(), l2.data(), q.data(), kv2.data(), T2, s, alloc);
  std::vector<float> out(q.size()), lse(nlse);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        const size_t li = static_cast<size_t>((b * s.H + h) * s.T + t);
        const double m = std::max(l1[li], l2[li]);
        const double merged = m + std::log(std::exp(l1[li] - m) + std::exp(l2[li] - m));
        lse[li] = static_cast<float>(merged);
        const double w1 = std::exp(l1[li] - merged), w2 = std::exp(l2[li] - merged);
        for (int64_t d = 0; d < s.D; ++d) {
          const size_t oi = static_cast<size_t>((b * s.T + t) * q_row + h * s.D + d);
          out[oi] = static_cast<float>(w1 * o1[oi] + w2 * o2[oi]);
        }
      }
  const Reference want = reference(all, q, kv, dout);
  expect_close(out, want.out, 2e-5, "merged out");
  expect_close(lse, want.lse, 2e-6, "merged lse");
  std::vector<float> dq1(q.size()), dq2(q.size()), dkv1(kv1.size()), dkv2(kv2.size());
  attention_block_backward(dq1.data(), dkv1.data(), dout.data(), out.data(), lse.data(), q.data(), kv1.data(), T1, s, alloc);
  attention_block_backward(dq2.data(), dkv2.data(), dout.data(), out.data(), lse.data(), q.data(), kv2.data(), T2, s, alloc);
  std::vector<float> dq(q.size()), dkv;
  for (size_t i = 0; i < dq.size(); ++i) dq[i] = dq1[i] + dq2[i];
  for (int64_t b = 0; b < s.B; ++b) {
    dkv.insert(dkv.end(), dkv1.begin() + b * T1 * kv_row, dkv1.begin() + (b + 1) * T1 * kv_row);
    dkv.insert(dkv.end(), dkv2.begin() + b * T2 * kv_row, dkv2.begin() + (b + 1) * T2 * kv_row);
  }
  expect_close(dq, want.dq, 5e-5, "summed dq");
  expect_close(dkv, want.dkv, 5e-5, "concatenated dkv");
}

// Both precisions: one thread runs the by-kv-head schedule, more the two-pass one; same sums, same order.
TEST(AttentionBlock, ResultsDoNotDependOnThreadCount) {
  for (bool bf16 : {false, true}) {
  SCOPED_TRACE(bf16 ? "bf16" : "f32");
  Allocator alloc;
  std::mt19937 rng(3);
  BlockShape bs = block(1, 200, 150, 4, 2, 64);
  bs.s.bf16 = bf16;
  const auto& s = bs.s;
  const auto q = random_vector(static_cast<size_t>(s.T * s.H * s.D), rng);
  const auto kv = random_vector(static_cast<size_t>(bs.Tk * 2 * s.KVH * s.D), rng);
  const auto dout = random_vector(q.size(), rng);
  auto run = [&](int threads) {
    loom::test::ScopedThreads t(threads);
    std::vector<float> out(q.size()), lse(static_cast<size_t>(s.H * s.T)), dq(q.size()), dkv(kv.size());
    attention_block_forward(out.data(), lse.data(), q.data(), kv.data(), bs.Tk, s, alloc);
    attention_block_backward(dq.data(), dkv.data(), dout.data(), out.data(), lse.data(), q.data(), kv.data(), bs.Tk, s,
                             alloc);
    out.insert(out.end(), dq.begin(), dq.end());
    out.insert(out.end(), dkv.begin(), dkv.end());
    return out;
  };
  const auto one = run(1);
  for (int threads : {2, 3, 8}) EXPECT_EQ(run(threads), one) << threads << " threads";
  }
}

// bf16 training's blocks run on the bf16 dot products, at self-attention's bf16 tolerances
// (attention_test.cpp): against float64 on f32 inputs (the inputs' rounding dominates), and on inputs
// that are bf16 already, where only the kernel's own rounding of P and dS remains.
// The same for the tile paths (AMX where ready, the software tile unit on any AVX512-BF16 CPU): a
// block's keys are a buffer of their own and no tile is diagonal.
TEST(AttentionBlock, Bf16PathMatchesFloat64AtBf16Tolerance) {
  if (!attention_path_supported(AttentionPath::Bf16Avx512)) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  for (AttentionPath path : {AttentionPath::Bf16Avx512, AttentionPath::Bf16Amx, AttentionPath::Bf16SoftwareAmx}) {
    if (!attention_path_supported(path)) continue;
    SCOPED_TRACE(attention_path_name(path));
    Allocator alloc;
    std::mt19937 rng(19);
    struct Tolerance {
      bool round_inputs;
      double out, lse, grad;
    };
    for (const Tolerance tol : {Tolerance{false, 6e-2, 8e-3, 1e-1}, Tolerance{true, 2e-2, 1e-6, 4e-2}})
      for (BlockShape bs : shapes()) {
        bs.s.bf16 = true;
        const auto& s = bs.s;
        auto q = random_vector(static_cast<size_t>(s.B * s.T * s.H * s.D), rng);
        auto kv = random_vector(static_cast<size_t>(s.B * bs.Tk * 2 * s.KVH * s.D), rng);
        auto dout = random_vector(q.size(), rng);
        if (tol.round_inputs) round_to_bf16(q), round_to_bf16(kv), round_to_bf16(dout);
        const Reference want = reference(bs, q, kv, dout);
        const std::string what = describe(bs) + (tol.round_inputs ? " bf16 inputs" : " f32 inputs");
        std::vector<float> out(q.size()), lse(static_cast<size_t>(s.B * s.H * s.T)), dq(q.size(), NAN),
            dkv(kv.size(), NAN);
        attention_block_forward(out.data(), lse.data(), q.data(), kv.data(), bs.Tk, s, alloc, path);
        expect_close(out, want.out, tol.out, what + " out");
        expect_close(lse, want.lse, tol.lse, what + " lse");
        attention_block_backward(dq.data(), dkv.data(), dout.data(), out.data(), lse.data(), q.data(), kv.data(), bs.Tk,
                                 s, alloc, path);
        // With one key dq is zero in exact arithmetic; bf16's dP (bf16 dO and V) against the f32 D = dO . out
        // leaves noise of about 2^-9 |dO| |v| scale there, so its floor is that scale (D = 16: ~0.05).
        expect_close(dq, want.dq, tol.grad, what + " dq", 5e-2);
        expect_close(dkv, want.dkv, tol.grad, what + " dkv");
      }
  }
}

// A block's last key tile is partial and not diagonal: its P must be zero past the last key even where
// exp(0 - lse) overflows (very negative scores), or a bf16 pair's zero key times an infinite dS is NaN.
TEST(AttentionBlock, APartialKeyTileWithVeryNegativeScoresStaysFinite) {
  Allocator alloc;
  BlockShape bs = block(1, 8, 5, 1, 1, 16);
  const auto& s = bs.s;
  std::vector<float> q(static_cast<size_t>(s.T * s.D), 4.0f), kv(static_cast<size_t>(bs.Tk * 2 * s.D), -12.0f);
  std::vector<float> dout(q.size(), 1.0f);
  for (bool bf16 : {false, true}) {
    bs.s.bf16 = bf16;
    std::vector<float> out(q.size()), lse(static_cast<size_t>(s.T)), dq(q.size()), dkv(kv.size());
    attention_block_forward(out.data(), lse.data(), q.data(), kv.data(), bs.Tk, bs.s, alloc);
    ASSERT_LT(lse[0], -150.0f) << "the scores must be very negative for this test";
    attention_block_backward(dq.data(), dkv.data(), dout.data(), out.data(), lse.data(), q.data(), kv.data(), bs.Tk,
                             bs.s, alloc);
    for (float x : dq) ASSERT_TRUE(std::isfinite(x)) << (bf16 ? "bf16" : "f32");
    for (float x : dkv) ASSERT_TRUE(std::isfinite(x)) << (bf16 ? "bf16" : "f32");
  }
}

TEST(AttentionBlock, RefusesAnEmptyBlock) {
  Allocator alloc;
  const BlockShape bs = block(1, 4, 4, 1, 1, 16);
  std::vector<float> q(64), kv(128), out(64), lse(4);
  EXPECT_THROW(attention_block_forward(out.data(), lse.data(), q.data(), kv.data(), 0, bs.s, alloc), ShapeError);
}

}  // namespace
}  // namespace loom::kernels
