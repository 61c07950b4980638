// The fp8 recipes' scaling state (model/fp8_recipe.h, issue 16 item 2): which scale each recipe uses
// for a tensor, how the delayed recipe's amax history moves across steps (the reduction over ranks
// feeds it), and that its state survives a round trip through what checkpoints save.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "loom/core/allocator.h"
#include "loom/error.h"
#include "loom/model/fp8_recipe.h"

namespace loom::model {
namespace {

// One [4, 8] f32 input whose largest |x| is `amax`, quantised as layer 0's qkv input; returns the
// element that carries the amax after quantisation and the step's stats via the recipe.
float quantise_input(Fp8Recipe& r, Allocator& alloc, float amax, float probe = 0) {
  Tensor x = Tensor::zeros({4, 8}, DType::F32, alloc, MemCategory::Activations);
  Tensor lp = Tensor::zeros({4, 8}, DType::BF16, alloc, MemCategory::Activations);
  x.data<float>()[0] = amax;
  x.data<float>()[1] = probe;
  r.quantize_input(0, Fp8Linear::Qkv, lp, x);
  return bf16_to_f32(lp.data<bf16>()[1]);
}

TEST(Fp8Recipe, DelayedScalingUsesTheLargestAmaxOfItsHistory) {
  Allocator alloc;
  Fp8Recipe r({Fp8Scaling::Delayed, 3}, 2, alloc);
  // Step 1: no history, the tensor's own amax (1.0: scale 256) -- 2^-10 is representable (2^-2 x 2^-8).
  EXPECT_EQ(quantise_input(r, alloc, 1.0f, std::ldexp(1.0f, -10)), std::ldexp(1.0f, -10));
  std::vector<float> reduced;
  r.end_step([&](std::span<float> amax, std::span<double>) {
    amax[0] = 64.0f;  // another rank saw 64: the reduction's max enters every rank's history
    reduced.assign(amax.begin(), amax.end());
  });
  ASSERT_EQ(r.histories().size(), 1u);
  EXPECT_EQ(r.histories()[0].first, "layers.0.qkv.input");
  EXPECT_EQ(r.histories()[0].second, std::vector<float>{64.0f});
  // Step 2: scale from the history (64: scale 4), not from this tensor (1.0, scale 256, under which
  // 2^-13 is a normal 2^-5): 2^-13 * 4 = 2^-11 is below half of E4M3's smallest subnormal 2^-9 ->
  // flushed to zero, and counted.
  EXPECT_EQ(quantise_input(r, alloc, 1.0f, std::ldexp(1.0f, -13)), 0.0f);
  r.end_step([](std::span<float>, std::span<double>) {});
  EXPECT_EQ(r.last_step_underflow(), 1);
  ASSERT_EQ(r.last_step_counts().size(), 1u);
  EXPECT_EQ(r.last_step_counts()[0].name, "layers.0.qkv.input");
  // The history keeps fp8.amax_history = 3 entries, newest last; a step that quantised nothing adds none.
  for (float a : {2.0f, 3.0f}) {
    quantise_input(r, alloc, a);
    r.end_step(nullptr);
  }
  r.end_step(nullptr);
  EXPECT_EQ(r.histories()[0].second, (std::vector<float>{1.0f, 2.0f, 3.0f}));
  // Overflow: amax 3 in history (scale 128), a tensor of 8 saturates at 448 / 128 = 3.5.
  EXPECT_EQ(quantise_input(r, alloc, 8.0f, 8.0f), 3.5f);
  r.end_step(nullptr);
  EXPECT_EQ(r.last_step_overflow(), 2);
}

TEST(Fp8Recipe, CurrentScalingUsesTheTensorItself) {
  Allocator alloc;
  Fp8Recipe r({Fp8Scaling::Current, 16}, 1, alloc);
  quantise_input(r, alloc, 64.0f);
  r.end_step(nullptr);
  // Scale from 1.0 (256), not from the 64 seen before: 2^-10 survives.
  EXPECT_EQ(quantise_input(r, alloc, 1.0f, std::ldexp(1.0f, -10)), std::ldexp(1.0f, -10));
}

TEST(Fp8Recipe, HistoriesRoundTripAndBadStateIsRefused) {
  Allocator alloc;
  Fp8Recipe a({Fp8Scaling::Delayed, 4}, 2, alloc);
  for (float v : {1.0f, 5.0f}) {
    quantise_input(a, alloc, v);
    a.end_step(nullptr);
  }
  Fp8Recipe b({Fp8Scaling::Delayed, 1}, 2, alloc);
  b.restore(a.histories());
  EXPECT_EQ(b.histories()[0].second, std::vector<float>{5.0f}) << "a shorter history keeps the newest";
  // Scaled by the restored 5 (scale 64: 2^-17 -> 2^-11, flushed), not by the tensor's own 1.0 (scale
  // 256: 2^-9, E4M3's smallest subnormal).
  EXPECT_EQ(quantise_input(b, alloc, 1.0f, std::ldexp(1.0f, -17)), 0.0f);
  Fp8Recipe fresh({Fp8Scaling::Delayed, 1}, 2, alloc);
  EXPECT_EQ(quantise_input(fresh, alloc, 1.0f, std::ldexp(1.0f, -17)), std::ldexp(1.0f, -17));
  EXPECT_THROW(b.restore({{"layers.7.qkv.input", {1.0f}}}), ConfigError);
  EXPECT_THROW(b.restore({{"layers.0.qkv.input", {NAN}}}), ConfigError);
  EXPECT_THROW(parse_fp8_scaling("tensorwise"), ConfigError);
}

}  // namespace
}  // namespace loom::model
