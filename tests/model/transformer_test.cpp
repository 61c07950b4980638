#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "loom/core/philox.h"
#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/model/transformer.h"

using namespace loom;
using namespace loom::model;

namespace {

struct Fixture {
  spec::TransformerConfig cfg;
  Allocator alloc;
  kernels::CpuBackend backend{alloc, nullptr, 2};
  ParameterStore params;
  Transformer model;
  Tensor tokens, targets;
  ActivationContext ctx;

  Fixture(const std::string& preset_name, Precision p, int64_t B, int64_t T, uint64_t seed,
          spec::Recompute recompute = spec::Recompute::None)
      : cfg(small(preset_name)),
        params(spec::build_param_table(cfg), p, alloc),
        model(cfg, params, backend, nullptr, recompute),
        tokens(Tensor::empty({B, T}, DType::I32, alloc, MemCategory::Activations)),
        targets(Tensor::empty({B, T}, DType::I32, alloc, MemCategory::Activations)),
        ctx(model.make_context(B, T)) {
    params.initialize(seed);
    // Perturb norms and biases away from their 1/0 init so their gradients are exercised.
    for (auto& s : params.table().params())
      if (s.shape.size() == 1) {
        Tensor t = params.param(s.name);
        for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] += 0.1f * Philox::normal(seed, 99, s.offset + i);
      }
    params.refresh_lowp();
    std::mt19937 rng(static_cast<uint32_t>(seed));
    for (int64_t i = 0; i < B * T; ++i) {
      tokens.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
      targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
    }
  }
  static spec::TransformerConfig small(const std::string& name) {
    auto c = spec::preset(name);
    c.vocab_size = 96;
    c.max_seq = 16;
    return c;
  }
  double loss() { return model.forward(ctx, tokens, targets, 0.0f); }
};

}  // namespace

class TransformerGradients : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformerGradients, MatchCentralFiniteDifferencesForEveryParameterTensor) {
  const uint64_t seed = 7;
  Fixture f(GetParam(), Precision::FP32, 2, 8, seed);
  f.params.zero_grads();
  const int64_t N = 2 * 8;
  f.model.forward(f.ctx, f.tokens, f.targets, 1.0f / N);
  f.model.backward(f.ctx);
  std::mt19937 rng(seed);
  for (auto& s : f.params.table().params()) {
    Tensor p = f.params.param(s.name), g = f.params.grad(s.name);
    // Three elements per tensor: the largest-gradient one, and two random ones.
    int64_t argmax = 0;
    for (int64_t i = 0; i < g.numel(); ++i)
      if (std::abs(g.data<float>()[i]) > std::abs(g.data<float>()[argmax])) argmax = i;
    for (int64_t i : {argmax, static_cast<int64_t>(rng() % p.numel()), static_cast<int64_t>(rng() % p.numel())}) {
      float& w = p.data<float>()[i];
      const float w0 = w, h = 1e-2f;
      w = w0 + h;
      double up = f.loss();
      w = w0 - h;
      double down = f.loss();
      w = w0;
      double numeric = (up - down) / (2 * h), analytic = g.data<float>()[i];
      EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 2e-4)
          << s.name << "[" << i << "] seed " << seed;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BothStyles, TransformerGradients, ::testing::Values("tiny", "tiny-llama"));

TEST(Transformer, InitialisationIsAPureFunctionOfSeedNameAndIndex) {
  auto cfg = spec::preset("tiny");
  Allocator alloc;
  ParameterStore a(spec::build_param_table(cfg), Precision::FP32, alloc);
  a.initialize(3);
  // A model with an extra layer has the same values for every tensor they share by name.
  auto deeper = cfg;
  deeper.n_layers = 3;
  ParameterStore b(spec::build_param_table(deeper), Precision::FP32, alloc);
  b.initialize(3);
  Tensor x = a.param("transformer.h.1.mlp.c_fc.weight"), y = b.param("transformer.h.1.mlp.c_fc.weight");
  EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes()));
  EXPECT_EQ(x.data<float>()[17], 0.02f * Philox::normal(3, stream_of("transformer.h.1.mlp.c_fc.weight"), 17));
  ParameterStore c(spec::build_param_table(cfg), Precision::FP32, alloc);
  c.initialize(4);
  EXPECT_NE(0, std::memcmp(x.raw(), c.param("transformer.h.1.mlp.c_fc.weight").raw(), x.nbytes()));
}

TEST(Transformer, InitialLossIsNearLogVocab) {
  Fixture f("tiny", Precision::FP32, 2, 16, 11);
  EXPECT_NEAR(f.loss(), std::log(96.0), 0.5);
}

TEST(Transformer, Bf16LossAndGradientsStayCloseToFp32) {
  for (auto name : {"tiny", "tiny-llama"}) {
    Fixture a(name, Precision::FP32, 2, 16, 5), b(name, Precision::BF16, 2, 16, 5);
    a.params.zero_grads(), b.params.zero_grads();
    double la = a.model.forward(a.ctx, a.tokens, a.targets, 1.0f / 32);
    double lb = b.model.forward(b.ctx, b.tokens, b.targets, 1.0f / 32);
    EXPECT_NEAR(la, lb, 1e-2 * la) << name;
    a.model.backward(a.ctx), b.model.backward(b.ctx);
    double diff = 0, ref = 0;
    for (int64_t i = 0; i < a.params.grads().numel(); ++i) {
      double d = a.params.grads().data<float>()[i] - b.params.grads().data<float>()[i];
      diff += d * d;
      ref += double(a.params.grads().data<float>()[i]) * a.params.grads().data<float>()[i];
    }
    EXPECT_LT(std::sqrt(diff / ref), 2e-2) << name;
  }
}

TEST(Transformer, RejectsTokensOutsideTheVocabulary) {
  Fixture f("tiny", Precision::FP32, 1, 4, 1);
  f.tokens.data<int32_t>()[2] = 96;
  EXPECT_THROW(f.loss(), ConfigError);
}

// Recompute runs the forward's own code again on the same inputs: the loss and every gradient are
// bitwise those of a run that kept everything (fp32 and bf16, GPT-2 and Llama, over two micro-batches
// accumulated through one context, so what backward refills is refilled for each), while the context
// keeps less: selective drops the attention core's output, full everything but the residual stream.
TEST(Transformer, RecomputeKeepsLessAndGivesBitwiseTheSameLossAndGradients) {
  using spec::Recompute;
  for (auto name : {"tiny", "tiny-llama"})
    for (Precision p : {Precision::FP32, Precision::BF16}) {
      auto run = [&](Recompute rc, std::vector<float>& grads, size_t& kept) {
        Fixture f(name, p, 2, 16, 7, rc);
        kept = f.alloc.stats(MemCategory::Activations).live;
        f.params.zero_grads();
        std::vector<double> losses;
        for (int micro = 0; micro < 2; ++micro) {
          std::swap(f.tokens, f.targets);  // a second, different micro-batch
          losses.push_back(f.model.forward(f.ctx, f.tokens, f.targets, 1.0f / 64));
          f.model.backward(f.ctx);
        }
        const Tensor& g = f.params.grads();
        grads.assign(g.data<float>(), g.data<float>() + g.numel());
        return losses;
      };
      std::vector<float> g_none, g;
      size_t kept_none = 0, kept = 0;
      const auto l_none = run(Recompute::None, g_none, kept_none);
      for (Recompute rc : {Recompute::Selective, Recompute::Full}) {
        const auto l = run(rc, g, kept);
        const std::string what = std::string(name) + " " + precision_name(p) + " " + std::string(spec::recompute_name(rc));
        EXPECT_EQ(l, l_none) << what;
        ASSERT_EQ(g.size(), g_none.size());
        EXPECT_EQ(std::memcmp(g.data(), g_none.data(), g.size() * sizeof(float)), 0) << what << ": gradients differ";
        EXPECT_LT(kept, kept_none) << what << ": the context keeps no less";
      }
    }
}

TEST(Transformer, RecomputeRefusesASplitBackward) {
  Fixture f("tiny", Precision::FP32, 1, 4, 1, spec::Recompute::Full);
  EXPECT_THROW(f.model.make_context(1, 4, {0, f.cfg.n_layers, true, true}, true), UnsupportedError);
}
