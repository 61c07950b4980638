// Hugging Face interchange: an export round-trips bitwise through import, GPT-2's Conv1D weights are
// transposed, and the PyTorch reference loads the exported file strictly by HF names and computes
// the same loss as Loom.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "../cli/cli_runner.h"
#include "loom/core/safetensors.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/model/transformer.h"
#include "loom/train/hf_interchange.h"

using namespace loom;
namespace fs = std::filesystem;

class HfExport : public ::testing::TestWithParam<std::string> {};

TEST_P(HfExport, PyTorchLoadsTheExportByNameAndAgreesOnTheLoss) {
  const uint64_t seed = 77;
  auto cfg = spec::preset(GetParam());
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, 2);
  model::ParameterStore params(spec::build_param_table(cfg), model::Precision::FP32, alloc);
  params.initialize(seed);
  auto dir = loom::test::scratch_dir("hf-" + GetParam());
  train::export_hf((dir / "hf.safetensors").string(), params, cfg, DType::F32, "");

  if (cfg.arch == spec::Arch::GPT2) {  // Conv1D layout: [in, out]
    SafetensorsFile f((dir / "hf.safetensors").string());
    EXPECT_EQ(f.at("transformer.h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{cfg.d_model, 3 * cfg.d_model}));
    const float* hf = static_cast<const float*>(f.at("transformer.h.0.mlp.c_fc.weight").data);
    Tensor w = params.param("transformer.h.0.mlp.c_fc.weight");  // [F, C]
    EXPECT_EQ(hf[5 * cfg.d_ff + 9], w.data<float>()[9 * cfg.d_model + 5]);
  }

  const int64_t B = 2, T = 16;
  Tensor tokens = Tensor::empty({B, T}, DType::I32, alloc, MemCategory::Activations);
  Tensor targets = Tensor::empty({B, T}, DType::I32, alloc, MemCategory::Activations);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  nlohmann::json tk = nlohmann::json::array(), tg = nlohmann::json::array();
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> a, c;
    for (int64_t t = 0; t < T; ++t) {
      a.push_back(tokens.data<int32_t>()[b * T + t] = static_cast<int32_t>(rng() % cfg.vocab_size));
      c.push_back(targets.data<int32_t>()[b * T + t] = static_cast<int32_t>(rng() % cfg.vocab_size));
    }
    tk.push_back(a), tg.push_back(c);
  }
  model::Transformer net(cfg, params, backend);
  auto ctx = net.make_context(B, T);
  const double loss = net.forward(ctx, tokens, targets, 0.0f);

  nlohmann::json in{{"config",
                     {{"arch", std::string(spec::arch_name(cfg.arch))}, {"vocab_size", cfg.vocab_size}, {"max_seq", cfg.max_seq},
                      {"d_model", cfg.d_model}, {"n_layers", cfg.n_layers}, {"n_heads", cfg.n_heads},
                      {"n_kv_heads", cfg.n_kv_heads}, {"d_ff", cfg.d_ff}, {"norm_eps", cfg.norm_eps},
                      {"rope_theta", cfg.rope_theta}, {"tie_embeddings", cfg.tie_embeddings}}},
                    {"tokens", tk}, {"targets", tg}, {"steps", 0},
                    {"weights", {{"file", "hf.safetensors"}, {"layout", "hf"}}},
                    {"adamw", {{"lr", 0.0}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.0}}}};
  std::ofstream(dir / "input.json") << in.dump();
  std::string cmd = "timeout 300 /usr/bin/python3 " LOOM_SOURCE_DIR "/tests/parity/torch_reference.py --dir " +
                    dir.string() + " > " + (dir / "log").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << std::ifstream(dir / "log").rdbuf();
  SafetensorsFile out((dir / "torch_out.safetensors").string());
  const double torch_loss = static_cast<const double*>(out.at("loss").data)[0];
  EXPECT_NEAR(loss, torch_loss, 1e-5 * torch_loss);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(BothStyles, HfExport, ::testing::Values("tiny", "tiny-llama"));

TEST(HfInterchange, ExportImportExportIsBitwiseAndForeignTensorsAreRefused) {
  using loom::test::run_loom;
  auto root = loom::test::scratch_dir("hf-cli");
  auto r = run_loom("train --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set train.steps=2 --set train.eval_every=0 "
                    "--set train.out_dir=" + (root / "out").string() + " --save-dir " + (root / "ck").string() +
                    " --save-every 2 --quiet");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto a = root / "a.safetensors", b = root / "b.safetensors";
  ASSERT_EQ(run_loom("export --checkpoint " + (root / "ck").string() + " --out " + a.string()).rc, 0);
  auto imp = run_loom("import --in " + a.string() + " --out " + (root / "ck2").string());
  ASSERT_EQ(imp.rc, 0) << imp.err;
  ASSERT_EQ(run_loom("export --checkpoint " + (root / "ck2").string() + " --out " + b.string()).rc, 0);
  SafetensorsFile fa(a.string()), fb(b.string());
  ASSERT_EQ(fa.tensors().size(), fb.tensors().size());
  for (auto& e : fa.tensors()) {
    ASSERT_EQ(e.nbytes, fb.at(e.name).nbytes) << e.name;
    EXPECT_EQ(0, std::memcmp(e.data, fb.at(e.name).data, e.nbytes)) << e.name;
  }
  // A file from another architecture is refused naming a tensor.
  auto wrong = run_loom("import --in " + a.string() + " --config " LOOM_SOURCE_DIR "/configs/tiny.toml --set model.preset=tiny-llama --out " +
                        (root / "ck3").string());
  EXPECT_EQ(wrong.rc, 1);
  EXPECT_NE(wrong.err.find("tensor '"), std::string::npos) << wrong.err;
  fs::remove_all(root);
}
