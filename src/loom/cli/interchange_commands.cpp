// `loom export` and `loom import`: Hugging Face-compatible safetensors in and out of checkpoints.
#include <fmt/format.h>

#include "loom/cli/commands.h"
#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/train/checkpoint.h"
#include "loom/train/hf_interchange.h"

namespace loom::cli {

namespace {

void require_hf(const std::string& format) {
  if (format != "hf") throw ConfigError("--format '" + format + "' is not supported (valid: hf)");
}


int run_import(const std::string& in, const std::string& config, const std::vector<std::string>& sets,
               const std::string& out, const std::string& format) {
  require_hf(format);
  train::RunConfig cfg;
  if (!config.empty()) {
    cfg = train::load_run_config(config, sets);
  } else {
    std::string embedded = train::hf_file_config(in);
    if (embedded.empty())
      throw ConfigError("'" + in + "' carries no Loom config; give --config FILE describing the model");
    cfg = train::parse_run_config(embedded, in + " (loom_config)", sets);
  }
  cfg.checkpoint.dir = out;
  // The import runs on this one process: the layout the model was (or will be) trained with does not
  // matter to whole tensors, and a resume may pick any.
  cfg.parallel.dp = cfg.parallel.tp = 1;
  cfg.parallel.zero = 0;
  cfg.validate();
  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, resolve_threads(cfg.train.threads));
  train::Trainer trainer(cfg, backend, 0);
  train::import_hf(in, trainer.params(), cfg.model.resolved);
  train::CheckpointManager manager(out, 0, /*resuming=*/false);
  std::string path = manager.save(trainer, 0);
  fmt::print(stderr, "imported {} into checkpoint {} (step 0, fresh optimizer state)\n", in, path);
  return 0;
}

}  // namespace

int run_export(const std::string& checkpoint, const std::string& out, const std::string& format, const std::string& dtype) {
  require_hf(format);
  const train::RunConfig cfg = train::checkpoint_config(checkpoint);
  Allocator alloc;
  model::ParameterStore params(spec::build_param_table(cfg.model.resolved), model::Precision::FP32, alloc);
  train::load_model_weights(checkpoint, params);
  train::export_hf(out, params, cfg.model.resolved, parse_dtype(dtype), cfg.to_toml());
  fmt::print(stderr, "exported {} ({}, {}) to {} with Hugging Face {} names\n", train::resolve_checkpoint(checkpoint),
             cfg.model.preset, spec::arch_name(cfg.model.resolved.arch), out,
             cfg.model.resolved.arch == spec::Arch::GPT2 ? "GPT2LMHeadModel" : "LlamaForCausalLM");
  return 0;
}

void register_interchange(CLI::App& app, Action& action) {
  auto* ex = app.add_subcommand("export", "Write a checkpoint's weights as Hugging Face safetensors");
  auto e = std::make_shared<std::array<std::string, 4>>();  // checkpoint, out, format, dtype
  (*e)[2] = "hf", (*e)[3] = "f32";
  ex->add_option("--checkpoint", (*e)[0], "a step-N checkpoint folder or a checkpoint dir")->required();
  ex->add_option("--out", (*e)[1], "output .safetensors file")->required();
  ex->add_option("--format", (*e)[2], "tensor naming and layout: hf")->capture_default_str();
  // Checked here: the dtype parser's own list (f32, bf16, i32, ...) named types export then refused.
  ex->add_option("--dtype", (*e)[3], "f32 or bf16")->capture_default_str()->check(CLI::IsMember({"f32", "bf16"}));
  ex->callback([&action, e] { action = [e] { return run_export((*e)[0], (*e)[1], (*e)[2], (*e)[3]); }; });

  auto* im = app.add_subcommand("import", "Make a Loom checkpoint from Hugging Face safetensors");
  struct ImportOptions {
    std::string in, config, out, format = "hf";
    std::vector<std::string> sets;
  };
  auto i = std::make_shared<ImportOptions>();
  im->add_option("--in", i->in, "Hugging Face .safetensors file")->required()->check(CLI::ExistingFile);
  im->add_option("--config", i->config, "TOML config of the model (default: the config embedded by loom export)");
  im->add_option("--set", i->sets, "override a config key (repeatable)");
  im->add_option("--out", i->out, "checkpoint directory to create")->required();
  im->add_option("--format", i->format, "tensor naming and layout: hf")->capture_default_str();
  im->callback([&action, i] { action = [i] { return run_import(i->in, i->config, i->sets, i->out, i->format); }; });
}

}  // namespace loom::cli
