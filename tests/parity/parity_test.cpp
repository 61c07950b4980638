// Parity with PyTorch: an independent reference written with stock torch.nn in the style of Hugging
// Face's GPT-2 and Llama code (torch_model.py) loads Loom's weights strictly by name and computes, in
// float64, the loss, every parameter gradient and three AdamW steps on the same batch.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "loom/core/safetensors.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/model/transformer.h"
#include "loom/train/adamw.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kB = 2, kT = 32, kSteps = 3;
// lr 1e-2 keeps updates of O(1) parameters (norm gains) well above fp32's resolution (ulp(1) = 1.2e-7).
constexpr double kLr = 1e-2, kClip = 1.0;

struct Reference {
  std::vector<double> loss;
  std::map<std::string, std::vector<double>> grad;
  std::vector<std::map<std::string, std::vector<double>>> after;  // after[k][name]: params after k+1 steps
};

std::vector<double> as_doubles(const SafetensorsEntry& e) {
  const double* p = static_cast<const double*>(e.data);
  return {p, p + e.nbytes / sizeof(double)};
}

// Writes the inputs, runs Debian's python3 (which has torch) and reads the float64 answers.
Reference run_torch(const fs::path& dir, const spec::TransformerConfig& c, const model::ParameterStore& params,
                    const Tensor& tokens, const Tensor& targets, double moe_aux_weight) {
  fs::create_directories(dir);
  std::vector<SafetensorsEntry> entries;
  nlohmann::json decay = nlohmann::json::array();
  for (auto& p : params.table().params()) {
    Tensor t = params.param(p.name);
    entries.push_back({p.name, DType::F32, p.shape, t.raw(), t.nbytes()});
    if (p.weight_decay) decay.push_back(p.name);
  }
  write_safetensors((dir / "weights.safetensors").string(), entries);
  auto rows = [](const Tensor& t) {
    nlohmann::json r = nlohmann::json::array();
    for (int64_t b = 0; b < t.dim(0); ++b)
      r.push_back(std::vector<int32_t>(t.data<int32_t>() + b * t.dim(1), t.data<int32_t>() + (b + 1) * t.dim(1)));
    return r;
  };
  nlohmann::json config{{"arch", std::string(spec::arch_name(c.arch))}, {"vocab_size", c.vocab_size},
                        {"max_seq", c.max_seq}, {"d_model", c.d_model}, {"n_layers", c.n_layers},
                        {"n_heads", c.n_heads}, {"n_kv_heads", c.n_kv_heads}, {"d_ff", c.d_ff},
                        {"norm_eps", c.norm_eps}, {"rope_theta", c.rope_theta}, {"tie_embeddings", c.tie_embeddings}};
  if (c.moe.enabled()) {
    const auto& m = c.moe;
    config["moe"] = {{"experts", m.experts}, {"top_k", m.top_k}, {"d_expert", m.d_expert},
                     {"shared_experts", m.shared_experts}, {"every", m.every}, {"first_dense", m.first_dense},
                     {"score", std::string(spec::router_score_name(m.score))}, {"normalize_top_k", m.normalize_top_k},
                     {"capacity_factor", m.capacity_factor}, {"aux_loss_coef", m.aux_loss_coef}};
  }
  nlohmann::json in{
      {"config", config},
      {"moe_aux_weight", moe_aux_weight},
      {"tokens", rows(tokens)},
      {"targets", rows(targets)},
      {"steps", kSteps},
      {"adamw",
       {{"lr", kLr}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"clip", kClip}, {"decay", decay}}}};
  std::ofstream(dir / "input.json") << in.dump();
  std::string cmd = "timeout 300 /usr/bin/python3 " + std::string(LOOM_SOURCE_DIR) + "/tests/parity/torch_reference.py --dir " +
                    dir.string() + " > " + (dir / "torch.log").string() + " 2>&1";
  int rc = std::system(cmd.c_str());
  if (rc != 0) {
    std::ifstream log(dir / "torch.log");
    std::string text((std::istreambuf_iterator<char>(log)), {});
    ADD_FAILURE() << "PyTorch reference failed (rc " << rc << "):\n" << text;
    return {};
  }
  SafetensorsFile out((dir / "torch_out.safetensors").string());
  Reference r;
  r.loss = as_doubles(out.at("loss"));
  for (auto& p : params.table().params()) {
    r.grad[p.name] = as_doubles(out.at("grad." + p.name));
  }
  r.after.resize(kSteps);
  for (int64_t k = 0; k < kSteps; ++k)
    for (auto& p : params.table().params())
      r.after[k][p.name] = as_doubles(out.at("step" + std::to_string(k + 1) + "." + p.name));
  return r;
}

double rel_l2(const float* a, const std::vector<double>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < b.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]), n += b[i] * b[i];
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-6);
}

// Adam divides by sqrt(v): where a gradient is pure rounding noise (mathematically ~0, e.g. the key
// bias, whose gradient softmax cancels exactly) the update amplifies that noise to O(lr) in any
// precision, and an element with |g| = tau * rms(g) sees the gradient's relative fp32 error (~1e-6)
// amplified by 1/tau. So updates are compared on the well-conditioned elements -- reference
// gradient above 0.1 of the tensor's RMS. After the first step every such element must match
// within 1e-5 of lr. Later steps mix consecutive gradients in m / sqrt(v); where they nearly cancel
// the fp32/fp64 difference grows again (seen up to 8e-5 of lr on gate_proj at step 3), so from step 2
// on the RMS over the tensor is held to 2e-4 of lr; the loss after every step is still held to 1e-5.
// `later_bound` replaces 2e-4: with capacity drops (sigmoid router, aux loss 0.1) steps 2-3 reached
// 4.0e-4 on a dense block's gate_proj while every routing decision was the same on both sides (the
// smallest top-k score margin was 2e-4, far above fp32 error) and every step-1 gradient matched to 6e-7.
void expect_updates_match(const model::ParameterStore& params, const Reference& ref, int64_t step,
                          double later_bound = 2e-4) {
  for (auto& p : params.table().params()) {
    const float* w = params.param(p.name).data<float>();
    const auto& f = ref.after[step].at(p.name);
    const auto& g = ref.grad.at(p.name);
    double g_rms = 0;
    for (double x : g) g_rms += x * x;
    g_rms = std::sqrt(g_rms / static_cast<double>(g.size()));
    double sq = 0, worst = 0;
    size_t used = 0;
    for (size_t i = 0; i < f.size(); ++i)
      if (std::abs(g[i]) > 0.1 * g_rms) {
        double d = std::abs(w[i] - f[i]);
        sq += d * d, worst = std::max(worst, d), ++used;
      }
    if (used == 0) continue;
    double rms = std::sqrt(sq / static_cast<double>(used));
    if (step == 0)
      EXPECT_LE(worst / kLr, 1e-5) << "first AdamW update of " << p.name << ": max |loom - torch| / lr over " << used
                                   << " of " << f.size() << " elements";
    else
      EXPECT_LE(rms / kLr, later_bound) << "AdamW step " << step + 1 << " of " << p.name << ": rms |loom - torch| / lr";
  }
}

struct Case {
  std::string preset;
  model::Precision precision;
  // A mixture-of-experts variant of the preset's model: "" (the preset as it is), "sigmoid-capacity-shared"
  // (Llama: sigmoid scores, capacity factor 0.75 with drops, a shared expert, MoE on the second block only),
  // "gpt2-moe" (GPT-2 block with softmax experts whose top-k weights are not renormalised).
  std::string variant = "";
};

spec::TransformerConfig case_config(const Case& cs) {
  auto cfg = spec::preset(cs.preset);
  if (cs.variant == "sigmoid-capacity-shared") {
    cfg.moe.score = spec::RouterScore::Sigmoid, cfg.moe.capacity_factor = 0.75, cfg.moe.shared_experts = 1;
    cfg.moe.every = 2, cfg.moe.d_expert = 96, cfg.moe.aux_loss_coef = 0.1;
  } else if (cs.variant == "gpt2-moe") {
    cfg.moe.experts = 3, cfg.moe.top_k = 2, cfg.moe.normalize_top_k = false, cfg.moe.aux_loss_coef = 0.05;
  }
  return cfg;
}

class TorchParity : public ::testing::TestWithParam<Case> {};

TEST_P(TorchParity, LossGradientsAndAdamWStepsMatchPyTorch) {
  const Case cs = GetParam();
  const bool fp32 = cs.precision == model::Precision::FP32;
  const uint64_t seed = 2024;
  std::printf("preset %s precision %s seed %llu\n", cs.preset.c_str(), model::precision_name(cs.precision),
              static_cast<unsigned long long>(seed));
  auto cfg = case_config(cs);
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, 2);
  model::ParameterStore params(spec::build_param_table(cfg), cs.precision, alloc);
  params.initialize(seed);
  model::Transformer net(cfg, params, backend);
  auto ctx = net.make_context(kB, kT);
  Tensor tokens = Tensor::empty({kB, kT}, DType::I32, alloc, MemCategory::Activations);
  Tensor targets = Tensor::empty({kB, kT}, DType::I32, alloc, MemCategory::Activations);
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < kB * kT; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % cfg.vocab_size);
  }
  targets.data<int32_t>()[5] = -1;  // an ignored position, as padding would be

  fs::path dir = fs::temp_directory_path() / ("loom-parity-" + cs.preset + cs.variant + "-" +
                                              model::precision_name(cs.precision) + "-" + std::to_string(::getpid()));
  int64_t valid = 0;
  for (int64_t i = 0; i < kB * kT; ++i) valid += targets.data<int32_t>()[i] >= 0;
  // Loom weighs the load-balancing loss by aux_loss_coef x the micro-batch's tokens x grad_scale.
  const double aux_weight = cfg.moe.aux_loss_coef * static_cast<double>(kB * kT) / static_cast<double>(valid);
  Reference ref = run_torch(dir, cfg, params, tokens, targets, aux_weight);
  ASSERT_EQ(ref.loss.size(), static_cast<size_t>(kSteps + 1));

  const double tol = fp32 ? 1e-5 : 2e-2;
  train::AdamW opt(params, {0.9, 0.95, 1e-8, 0.1}, alloc);
  for (int64_t step = 0; step <= kSteps; ++step) {
    params.zero_grads();
    double loss = net.forward(ctx, tokens, targets, 1.0f / static_cast<float>(valid));
    EXPECT_NEAR(loss, ref.loss[step], tol * ref.loss[step]) << "loss before step " << step + 1;
    if (step == 0 && cfg.moe.capacity_factor > 0) {
      int64_t dropped = 0;
      for (const auto& l : net.moe_load()) dropped += l.dropped;
      EXPECT_GT(dropped, 0) << "the capacity case must drop tokens to test dropping";
    }
    if (step == kSteps) break;
    net.backward(ctx);
    if (step == 0)
      for (auto& p : params.table().params()) {
        double e = rel_l2(params.grad(p.name).data<float>(), ref.grad[p.name]);
        EXPECT_LE(e, tol) << "gradient of " << p.name;
        if (std::getenv("LOOM_PARITY_VERBOSE")) std::printf("grad %-40s rel %.3g\n", p.name.c_str(), e);
      }
    double norm = train::global_grad_norm(params);
    opt.step(kLr, norm > kClip ? kClip / norm : 1.0, nullptr);
    if (fp32) expect_updates_match(params, ref, step, cfg.moe.capacity_factor > 0 ? 6e-4 : 2e-4);
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Styles, TorchParity,
                         ::testing::Values(Case{"tiny", model::Precision::FP32}, Case{"tiny-llama", model::Precision::FP32},
                                           Case{"tiny", model::Precision::BF16},
                                           Case{"tiny-llama", model::Precision::BF16},
                                           Case{"tiny-moe", model::Precision::FP32}, Case{"tiny-moe", model::Precision::BF16},
                                           Case{"tiny-moe", model::Precision::FP32, "sigmoid-capacity-shared"},
                                           Case{"tiny", model::Precision::FP32, "gpt2-moe"}),
                         [](const auto& info) {
                           std::string n = info.param.preset + info.param.variant + "_" +
                                           model::precision_name(info.param.precision);
                           for (auto& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace
