// `loom ckpt inspect DIR`: what a checkpoint holds, offline -- the step, the model and the layout it
// was saved from, the tokenizer, every tensor's shape, dtype and size, and every checksum verified
// against the bytes on disk (exit 1 naming each damaged or missing tensor), so a checkpoint can be
// trusted (or not) before a long job resumes from it.
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "loom/cli/commands.h"
#include "loom/core/checksum.h"
#include "loom/core/safetensors.h"
#include "loom/error.h"
#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_convert.h"
#include "loom/train/checkpoint_manifest.h"
#include "loom/train/checkpoint_reader.h"
#include "loom/train/run_config.h"

namespace loom::cli {

namespace {

namespace fs = std::filesystem;

struct InspectOptions {
  std::string path;
  bool json = false;
};

struct TensorRow {
  std::string name, file, param, dtype, status;  // status: "ok", "checksum mismatch", "missing"
  std::vector<int64_t> shape;
  size_t bytes = 0;
};

std::string mib(double bytes) { return fmt::format("{:.2f} MiB", bytes / 1048576.0); }

int inspect(const InspectOptions& o) {
  const fs::path dir = train::resolve_checkpoint(o.path);
  const train::CheckpointManifest m = train::read_checkpoint_manifest(dir.string());
  const train::RunConfig cfg = train::checkpoint_config(dir.string());
  const auto& mc = cfg.model.resolved;
  // Each file is read once; a missing or unreadable one marks its tensors, the rest are still checked.
  std::map<std::string, std::optional<SafetensorsFile>> files;
  std::map<std::string, std::string> file_errors;
  for (const auto& t : m.tensors) {
    if (files.count(t.file) || file_errors.count(t.file)) continue;
    try {
      files[t.file].emplace((dir / t.file).string());
    } catch (const Error& e) {
      files.erase(t.file);
      file_errors[t.file] = e.what();
    }
  }
  std::vector<TensorRow> rows;
  size_t bad = 0, total_bytes = 0;
  for (const auto& t : m.tensors) {
    TensorRow r{t.name, t.file, t.param, "-", "missing", {}, 0};
    auto f = files.find(r.file);
    if (f != files.end() && f->second && f->second->contains(t.name)) {
      const auto& file = f->second;
      const auto& e = file->at(t.name);
      r.dtype = dtype_name(e.dtype), r.shape = e.shape, r.bytes = e.nbytes;
      r.status = checksum_hex(checksum64(e.data, e.nbytes)) == t.checksum ? "ok" : "checksum mismatch";
      total_bytes += e.nbytes;
    }
    bad += r.status != "ok";
    rows.push_back(std::move(r));
  }
  // Every element of every tensor held by some piece (a sharded checkpoint whose index leaves a hole
  // cannot be resumed from).
  const std::vector<std::string> holes = train::CheckpointReader(dir, m).holes();
  bad += holes.size();
  const std::string layout =
      fmt::format("dp={} tp={} pp={} zero={}{}{}{}", cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero,
                  cfg.parallel.cp > 1 ? fmt::format(" cp={}", cfg.parallel.cp) : "",
                  cfg.parallel.ep > 1 ? fmt::format(" ep={}", cfg.parallel.ep) : "",
                  cfg.parallel.sequence_parallel ? " sp" : "");
  if (o.json) {
    nlohmann::json j{{"path", dir.string()},
                     {"version", m.version},
                     {"step", m.step},
                     {"optimizer_steps", m.optimizer_steps},
                     {"run_id", m.run_id},
                     {"model",
                      {{"preset", cfg.model.preset},
                       {"arch", std::string(spec::arch_name(mc.arch))},
                       {"n_layers", mc.n_layers},
                       {"d_model", mc.d_model},
                       {"n_heads", mc.n_heads},
                       {"n_kv_heads", mc.n_kv_heads},
                       {"d_ff", mc.d_ff},
                       {"vocab_size", mc.vocab_size}}},
                     {"saved_layout", layout},
                     {"precision", cfg.precision_label()},
                     {"tensor_bytes", total_bytes},
                     {"damaged", bad}};
    if (m.tokenizer) j["tokenizer"] = {{"file", m.tokenizer->file}, {"hash", m.tokenizer->hash}};
    j["ranks"] = m.ranks;
    j["files"] = files.size() + file_errors.size();
    j["holes"] = holes;
    for (const auto& [f, why] : file_errors) j["file_errors"][f] = why;
    for (const auto& r : rows)
      j["tensors"].push_back({{"name", r.name},
                              {"file", r.file},
                              {"param", r.param},
                              {"dtype", r.dtype},
                              {"shape", r.shape},
                              {"bytes", r.bytes},
                              {"status", r.status}});
    std::cout << j.dump(2) << "\n";
    return bad ? 1 : 0;
  }
  fmt::print("checkpoint {} (loom-checkpoint v{})\n", dir.string(), m.version);
  fmt::print("step {} (optimizer steps {}){}\n", m.step, m.optimizer_steps,
             m.run_id.empty() ? "" : fmt::format(", run {}", m.run_id));
  fmt::print("model: {} ({}: {} layers, d_model {}, {} heads / {} KV heads, d_ff {}, vocabulary {})\n",
             cfg.model.preset.empty() ? "custom" : cfg.model.preset, spec::arch_name(mc.arch), mc.n_layers, mc.d_model,
             mc.n_heads, mc.n_kv_heads, mc.d_ff, mc.vocab_size);
  fmt::print("saved from: {}, precision {}; {} by {} rank(s) in {} file(s) (any layout resumes from it)\n", layout,
             cfg.precision_label(), m.version >= 2 && m.ranks > 1 ? "sharded" : "whole tensors", m.ranks,
             files.size() + file_errors.size());
  fmt::print("tokenizer: {}\n", m.tokenizer ? fmt::format("{} (hash {})", m.tokenizer->file, m.tokenizer->hash)
                                            : std::string("none (synthetic data)"));
  for (const auto& [f, why] : file_errors) fmt::print("{}: cannot be read: {}\n", f, why);
  size_t name_w = 6;
  for (const auto& r : rows) name_w = std::max(name_w, r.name.size());
  fmt::print("{:<{}}  {:<22} {:<8} {:>12}  {}\n", "tensor", name_w, "shape", "dtype", "bytes", "checksum");
  for (const auto& r : rows)
    fmt::print("{:<{}}  {:<22} {:<8} {:>12}  {}\n", r.name, name_w, nlohmann::json(r.shape).dump(), r.dtype, r.bytes,
               r.status);
  fmt::print("{} tensors, {} in all\n", rows.size(), mib(static_cast<double>(total_bytes)));
  for (const auto& h : holes) fmt::print("NOT COVERED: {}\n", h);
  if (bad == 0) {
    fmt::print("all {} checksums verified\n", rows.size());
    return 0;
  }
  fmt::print("{} of {} tensors DAMAGED or missing: resume from an earlier checkpoint\n", bad, rows.size());
  return 1;
}

struct ConvertOptions {
  std::string src, out, to, layout, dtype = "f32";
};

int convert(const ConvertOptions& o) {
  if (o.to.empty() == o.layout.empty())
    throw ConfigError("loom ckpt convert: give exactly one of --to hf and --to-layout \"dp=..,tp=..,pp=..,zero=..\"");
  if (!o.to.empty()) {
    if (o.to != "hf") throw ConfigError("loom ckpt convert --to '" + o.to + "': the only target format is hf");
    return run_export(o.src, o.out, "hf", o.dtype);
  }
  const std::string path = train::convert_checkpoint_layout(o.src, o.out, train::parse_target_layout(o.layout));
  fmt::print(stderr, "converted {} to {} for layout {}\n", train::resolve_checkpoint(o.src), path, o.layout);
  return 0;
}

}  // namespace

void register_ckpt(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("ckpt", "Work with checkpoints offline");
  cmd->require_subcommand(1);
  auto o = std::make_shared<InspectOptions>();
  auto* inspect_cmd = cmd->add_subcommand(
      "inspect",
      "The step, model, saved layout, tokenizer and every tensor of a checkpoint, checksums verified "
      "(exit 1 when any tensor is damaged or missing)");
  inspect_cmd->add_option("path", o->path, "a checkpoint folder (step-NNNNNNNN) or a checkpoint.dir (its latest)")
      ->required();
  inspect_cmd->add_flag("--json", o->json, "print it as JSON");
  inspect_cmd->callback([&action, o] { action = [o] { return inspect(*o); }; });

  auto c = std::make_shared<ConvertOptions>();
  auto* convert_cmd = cmd->add_subcommand(
      "convert",
      "Rewrite a checkpoint for another layout (--to-layout: the sharded files that layout saves) or as "
      "Hugging Face safetensors (--to hf)");
  convert_cmd->add_option("src", c->src, "a checkpoint folder (step-NNNNNNNN) or a checkpoint.dir (its latest)")
      ->required();
  convert_cmd->add_option("out", c->out, "--to-layout: a new checkpoint.dir; --to hf: the output .safetensors file (as `loom export --out`)")->required();
  convert_cmd->add_option("--to", c->to, "hf: Hugging Face safetensors + config.json (as `loom export`)");
  convert_cmd->add_option("--to-layout", c->layout, "e.g. \"dp=4,tp=2,pp=1,zero=1\" (unnamed axes: 1, zero: 0)");
  convert_cmd->add_option("--dtype", c->dtype, "--to hf: f32 or bf16 (default f32)")->check(CLI::IsMember({"f32", "bf16"}));
  convert_cmd->callback([&action, c] { action = [c] { return convert(*c); }; });
}

}  // namespace loom::cli
