#include "loom/train/checkpoint_convert.h"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "loom/core/file_reader.h"
#include "loom/error.h"
#include "loom/spec/pipeline_stages.h"
#include "loom/train/checkpoint.h"
#include "loom/train/checkpoint_manifest.h"
#include "loom/train/checkpoint_reader.h"
#include "loom/train/run_config.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

TargetLayout parse_target_layout(const std::string& text) {
  TargetLayout t;
  std::string item;
  std::istringstream in(text);
  bool any = false;
  while (in >> item) {
    std::istringstream parts(item);
    for (std::string kv; std::getline(parts, kv, ',');) {
      if (kv.empty()) continue;
      const auto eq = kv.find('=');
      const std::string key = kv.substr(0, eq);
      int64_t v = -1;
      try {
        if (eq != std::string::npos) v = std::stoll(kv.substr(eq + 1));
      } catch (const std::exception&) {
      }
      int64_t* slot = key == "dp" ? &t.dp : key == "tp" ? &t.tp : key == "pp" ? &t.pp : key == "zero" ? &t.zero : nullptr;
      if (!slot || v < (key == "zero" ? 0 : 1) || (key == "zero" && v > 3))
        throw ConfigError("--to-layout: '" + kv + "' is not a layout item (dp=N, tp=N, pp=N with N >= 1, zero=0..3)");
      *slot = v;
      any = true;
    }
  }
  if (!any) throw ConfigError("--to-layout is empty: give e.g. \"dp=4,tp=2,pp=1,zero=1\"");
  return t;
}

std::string convert_checkpoint_layout(const std::string& src_path, const std::string& out, const TargetLayout& to) {
  const fs::path src = resolve_checkpoint(src_path);
  {
    std::error_code ec;
    if (fs::exists(out, ec) && !fs::is_empty(out, ec))
      throw ConfigError("loom ckpt convert: '" + out + "' exists and is not empty; give a new folder for the converted "
                        "checkpoint (nothing was overwritten)");
  }
  const CheckpointManifest m = read_checkpoint_manifest(src.string());
  // The target's config: the source's with the new layout, validated as a run's would be.
  RunConfig cfg = parse_run_config(m.config_toml, (src / "manifest.json").string());
  cfg.parallel.dp = to.dp, cfg.parallel.tp = to.tp, cfg.parallel.pp = to.pp, cfg.parallel.zero = to.zero;
  if (to.pp == 1) cfg.parallel.pipeline_layers.clear();
  cfg = parse_run_config(cfg.to_toml(), "--to-layout");
  const auto& model = cfg.model.resolved;
  spec::validate_tensor_parallel(model, static_cast<int>(to.tp));
  std::optional<spec::PipelineStages> stages;
  if (to.pp > 1)
    stages = spec::cut_pipeline(model, cfg.seq_len(), static_cast<int>(to.pp),
                                static_cast<int>(cfg.parallel.pipeline_virtual_stages),
                                spec::parse_layer_counts(cfg.parallel.pipeline_layers, "parallel.pipeline.layers"));
  const int ranks = static_cast<int>(to.dp * to.tp * to.pp);

  // The source's record, with the new layout; tensors come from the ranks' parts.
  json facts = json::parse(read_file(src / "manifest.json"));
  for (const char* k : {"format", "version", "step", "run_id", "created_unix", "tensors", "tokenizer"}) facts.erase(k);
  facts["config_toml"] = cfg.to_toml();
  facts["ranks"] = ranks;
  facts["world"] = {{"ranks", ranks},
                    {"layout", {{"dp", to.dp}, {"tp", to.tp}, {"pp", to.pp}, {"cp", 1}, {"ep", 1}, {"zero", to.zero}}}};
  if (!facts.contains("params")) {
    json params = json::array();
    for (const auto& p : m.params) params.push_back({{"name", p.name}, {"shape", p.shape}, {"placement", p.placement}});
    facts["params"] = params;
  }

  CheckpointReader reader(src, m);
  // Rank 0's manager first: it refuses an `out` holding checkpoints and clears stale temporary folders,
  // which must happen before the other ranks' parts are written.
  CheckpointManager lead(out, 0, /*resuming=*/false, 0, ranks);
  std::string written;
  // Rank 0 last: its write finishes the checkpoint once every other rank's part is there.
  for (int r = ranks - 1; r >= 0; --r) {
    const int tp_rank = static_cast<int>(r % to.tp), dp_rank = static_cast<int>((r / to.tp) % to.dp);
    const int pp_rank = static_cast<int>(r / (to.tp * to.dp));
    spec::TableShard shard = stages ? stages->shard_of(pp_rank) : spec::TableShard{};
    shard.tp_rank = tp_rank, shard.tp_size = static_cast<int>(to.tp);
    const spec::ParamTable table = spec::build_param_table(model, shard);
    const auto pieces = save_pieces(table, saved_ranges(table, model.n_layers, static_cast<int>(to.dp), dp_rank, {}));

    std::optional<CheckpointManager> other;
    if (r != 0) other.emplace(out, 0, /*resuming=*/true, r, ranks), other->set_run_id(lead.run_id());
    CheckpointManager& manager = r == 0 ? lead : *other;
    CheckpointImage img;
    img.step = m.step;
    name_shard_files(img, r, ranks);
    int64_t total = 0;
    for (const auto& p : pieces) total += p.end - p.begin;
    std::vector<float> state(static_cast<size_t>(3 * std::max<int64_t>(total, 1)));
    float* at = state.data();
    std::unordered_map<std::string, int> seen;
    for (const auto& piece : pieces) {
      const auto& p = table.params()[piece.param];
      const int64_t n = piece.end - piece.begin;
      const float* data[3] = {at, at + n, at + 2 * n};
      reader.read(table, p, TensorRole::Weight, piece.begin - p.offset, piece.end - p.offset, at);
      reader.read(table, p, TensorRole::ExpAvg, piece.begin - p.offset, piece.end - p.offset, at + n);
      reader.read(table, p, TensorRole::ExpAvgSq, piece.begin - p.offset, piece.end - p.offset, at + 2 * n);
      add_piece(img, p, piece, data, seen);
      at += 3 * n;
    }
    if (r == 0) {
      img.facts = facts;
      if (m.tokenizer) img.tokenizer_file = (src / m.tokenizer->file).string(), img.tokenizer_hash = m.tokenizer->hash;
    }
    written = manager.write(img);
  }
  return written;
}

}  // namespace loom::train
