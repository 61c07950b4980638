// Pipeline chunks of the model, run in one process: the model cut into chunks held by different
// parameter stores (pipeline shards of the table, initialised from the same seed), each chunk's output
// handed to the next and each gradient back, must give the whole model's loss and every parameter's
// gradient; a tied embedding's two copies (first and last stage) sum to the whole model's gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "loom/kernels/cpu_backend.h"
#include "loom/model/transformer.h"

namespace loom::model {
namespace {

struct Stage {
  std::unique_ptr<ParameterStore> params;
  std::unique_ptr<Transformer> net;
  std::vector<Transformer::Chunk> chunks;  // this stage's chunks, in model order
  std::vector<ActivationContext> ctx;      // one per chunk
};

double max_rel(const Tensor& a, const Tensor& b) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    diff = std::max(diff, std::abs(x - y));
    norm = std::max(norm, std::abs(x));
  }
  return diff / std::max(norm, 1e-30);
}

// layers: blocks per global chunk; chunk g lives on stage g % pp.
// split: each chunk's backward in two passes (zero-bubble): every input-gradient pass first, the
// weight-gradient passes after them all, in another order.
void check_chunks_match_the_whole_model(spec::TransformerConfig cfg, int pp, std::vector<int64_t> layers,
                                        bool split = false) {
  const uint64_t seed = 5;
  const int64_t B = 2, T = 16;
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, 2);
  ParameterStore whole_params(spec::build_param_table(cfg), Precision::FP32, alloc);
  whole_params.initialize(seed);
  Transformer whole(cfg, whole_params, backend);
  Tensor tokens = Tensor::empty({B, T}, DType::I32, alloc, MemCategory::Activations);
  Tensor targets = Tensor::empty({B, T}, DType::I32, alloc, MemCategory::Activations);
  std::mt19937 rng(11);
  for (int64_t i = 0; i < B * T; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
  }
  const float scale = 1.0f / static_cast<float>(B * T);
  auto wctx = whole.make_context(B, T);
  whole_params.zero_grads();
  const double want = whole.forward(wctx, tokens, targets, scale);
  whole.backward(wctx);

  const int K = static_cast<int>(layers.size());
  std::vector<Transformer::Chunk> chunk(static_cast<size_t>(K));
  int64_t at = 0;
  for (int g = 0; g < K; ++g) {
    chunk[static_cast<size_t>(g)] = {at, at + layers[static_cast<size_t>(g)], g == 0, g == K - 1};
    at += layers[static_cast<size_t>(g)];
  }
  std::vector<Stage> stages(static_cast<size_t>(pp));
  for (int r = 0; r < pp; ++r) {
    spec::TableShard shard;
    for (int g = r; g < K; g += pp) shard.blocks.push_back({chunk[g].first, chunk[g].last});
    shard.embeddings = r == 0;
    shard.head = r == (K - 1) % pp;
    Stage& s = stages[static_cast<size_t>(r)];
    s.params = std::make_unique<ParameterStore>(spec::build_param_table(cfg, shard), Precision::FP32, alloc);
    s.params->initialize(seed);
    s.params->zero_grads();
    s.net = std::make_unique<Transformer>(cfg, *s.params, backend);
  }
  std::vector<ActivationContext> ctx;
  for (int g = 0; g < K; ++g) ctx.push_back(stages[static_cast<size_t>(g % pp)].net->make_context(B, T, chunk[g], split));
  double got = 0;
  for (int g = 0; g < K; ++g) {
    auto& c = ctx[static_cast<size_t>(g)];
    if (g > 0) c.residual[static_cast<size_t>(chunk[g].first)].copy_from(ctx[g - 1].residual[static_cast<size_t>(chunk[g].first)]);
    got = stages[static_cast<size_t>(g % pp)].net->forward_chunk(c, chunk[g], &tokens, &targets, scale);
  }
  EXPECT_NEAR(got, want, 1e-6 * want);
  for (int g = K - 1; g >= 0; --g) {
    auto& c = ctx[static_cast<size_t>(g)];
    if (g < K - 1) c.d_res.copy_from(ctx[g + 1].d_res);
    if (split)
      stages[static_cast<size_t>(g % pp)].net->backward_chunk_input(c, chunk[g]);
    else
      stages[static_cast<size_t>(g % pp)].net->backward_chunk(c, chunk[g]);
  }
  if (split)
    for (int g = 0; g < K; ++g) stages[static_cast<size_t>(g % pp)].net->backward_chunk_weight(ctx[static_cast<size_t>(g)], chunk[g]);
  // Every parameter's gradient, by name; a tensor on several stages (the tied embedding) sums.
  for (const auto& p : whole_params.table().params()) {
    Tensor sum = Tensor::zeros({p.numel()}, DType::F32, alloc, MemCategory::Workspace);
    int holders = 0;
    for (auto& s : stages) {
      if (!s.params->table().index_of(p.name)) continue;
      ++holders;
      const Tensor g = s.params->grad(p.name);
      for (int64_t i = 0; i < p.numel(); ++i) sum.data<float>()[i] += g.data<float>()[i];
    }
    ASSERT_GE(holders, 1) << p.name << " is on no stage";
    EXPECT_LT(max_rel(whole_params.grad(p.name).reshape({p.numel()}), sum), 1e-5) << p.name;
  }
}

TEST(PipelineChunks, TwoStagesGiveTheWholeModelsLossAndGradients) {
  for (const char* name : {"tiny", "tiny-llama"}) {
    SCOPED_TRACE(name);
    check_chunks_match_the_whole_model(spec::preset(name), 2, {1, 1});
  }
}

TEST(PipelineChunks, UntiedHeadsAndUnevenStages) {
  auto cfg = spec::preset("tiny-llama");
  cfg.tie_embeddings = false;
  cfg.n_layers = 5;
  check_chunks_match_the_whole_model(cfg, 3, {1, 3, 1});
  check_chunks_match_the_whole_model(cfg, 2, {0, 5});  // a first stage holding only the embedding
}

TEST(PipelineChunks, InterleavedChunksOnOneStageAreNotContiguous) {
  auto cfg = spec::preset("tiny");
  cfg.n_layers = 4;
  // pp = 2, v = 2: stage 0 holds chunks 0 and 2 (blocks 0 and 2), stage 1 chunks 1 and 3.
  check_chunks_match_the_whole_model(cfg, 2, {1, 1, 1, 1});
}

TEST(PipelineChunks, ASplitBackwardAddsWhatTheWholeBackwardAdds) {
  for (const char* name : {"tiny", "tiny-llama"}) {
    SCOPED_TRACE(name);
    auto cfg = spec::preset(name);
    cfg.n_layers = 4;
    check_chunks_match_the_whole_model(cfg, 2, {1, 1, 1, 1}, true);
    check_chunks_match_the_whole_model(cfg, 2, {3, 1}, true);
  }
}

}  // namespace
}  // namespace loom::model
