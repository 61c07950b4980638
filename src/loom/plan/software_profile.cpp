#include "loom/plan/software_profile.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <toml++/toml.h>

#include "loom/error.h"

namespace loom::plan {

namespace {

Software named(const std::string& name) {
  Software s;  // Megatron-Core's defaults
  s.profile = name;
  if (name == "megatron") return s;
  if (name == "megatron-2021") {  // before the distributed optimizer (2022)
    s.flash_attention = false, s.dropout = true, s.dp_overlap = false, s.max_zero = 0;
    return s;
  }
  if (name == "deepspeed") {
    s.sequence_parallel = false, s.grad_bytes = 2;
    return s;
  }
  if (name == "nemo") {  // Megatron-Core as NeMo launches it: distributed_fused_adam, grad_sync_dtype bf16
    s.grad_bytes = 2, s.max_zero = 1;
    return s;
  }
  if (name == "pytorch-fsdp") {  // PyTorch FSDP stacks (Composer/llm-foundry, fms-fsdp): SDPA, no TP/SP
    s.sequence_parallel = false;
    s.no_recompute_slowdown = 0.15;  // in-sample fit (`loom plan --validate`, docs/planner.md)
    return s;
  }
  if (name == "neuron") {  // NeuronX Distributed's ZeRO-1 optimizer; no ZeRO-2/3
    s.max_zero = 1;
    return s;
  }
  if (name == "loom") {
    s.loom_engine = true, s.zero_bubble = true;
    return s;
  }
  std::string valid;
  for (const auto& n : software_profile_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw ConfigError("software profile '" + name + "' is not known (valid: " + valid + ", or a .toml file with a [software] table)");
}

}  // namespace

std::vector<std::string> software_profile_names() { return {"megatron", "megatron-2021", "nemo", "deepspeed", "pytorch-fsdp", "neuron", "loom"}; }

Software parse_software_profile(const std::string& text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}: line {}: {}", origin, e.source().begin.line, e.description()));
  }
  const toml::table* t = root["software"].as_table();
  if (!t) throw ConfigError(origin + ": a software profile needs a [software] table");
  auto fail = [&](const std::string& key, const std::string& why) -> void {
    throw ConfigError(origin + ": software." + key + " " + why);
  };
  auto string = [&](const char* key, const std::string& fallback) {
    const toml::node* n = t->get(key);
    if (!n) return fallback;
    if (!n->is_string()) fail(key, "must be a string");
    return n->as_string()->get();
  };
  Software s = named(string("base", "megatron"));
  s.profile = string("name", std::filesystem::path(origin).stem().string());
  auto flag = [&](const char* key, bool& out) {
    if (const toml::node* n = t->get(key)) {
      if (!n->is_boolean()) fail(key, "must be true or false");
      out = n->as_boolean()->get();
    }
  };
  flag("flash_attention", s.flash_attention);
  flag("dropout", s.dropout);
  flag("dp_overlap", s.dp_overlap);
  flag("tp_overlap", s.tp_overlap);
  flag("sequence_parallel", s.sequence_parallel);
  flag("zero_bubble", s.zero_bubble);
  if (const toml::node* n = t->get("max_zero")) {
    const auto v = n->value<int64_t>();
    if (!v || *v < 0 || *v > 3) fail("max_zero", "must be 0, 1, 2 or 3 (the highest ZeRO stage the software runs)");
    s.max_zero = static_cast<int>(*v);
  }
  if (const toml::node* n = t->get("grad_bytes")) {
    const auto v = n->value<double>();
    if (!v || (*v != 2 && *v != 4)) fail("grad_bytes", "must be 2 (16-bit gradient reduction) or 4 (fp32)");
    s.grad_bytes = *v;
  }
  const std::string recompute = string("recompute", s.recompute ? std::string(recompute_name(*s.recompute)) : "search");
  if (recompute == "search")
    s.recompute.reset();
  else if (recompute == "none" || recompute == "selective" || recompute == "full")
    s.recompute = spec::parse_recompute(recompute);
  else
    fail("recompute", "= \"" + recompute + "\" is not \"search\", \"none\", \"selective\" or \"full\"");
  if (const toml::node* n = t->get("no_recompute_slowdown")) {
    const auto v = n->value<double>();
    if (!v || !(*v >= 0 && *v <= 1))
      fail("no_recompute_slowdown", "must be a number in [0, 1] (the fraction by which a run without activation recompute "
                                    "runs slower than its kernels' sum)");
    s.no_recompute_slowdown = *v;
  }
  if (t->contains("attention_kernel")) {
    try {
      set_attention_kernel(s, string("attention_kernel", s.attention_kernel));
    } catch (const ConfigError& e) {
      fail("attention_kernel", std::string("= ") + e.what());
    }
    if (!s.flash_attention && s.attention_kernel != "flash2")
      fail("attention_kernel", "names a flash-attention kernel, but flash_attention = false (materialised scores)");
  }
  s.fp8_recipe = string("fp8_recipe", s.fp8_recipe);
  if (s.fp8_recipe != "delayed" && s.fp8_recipe != "current" && s.fp8_recipe != "blockwise")
    fail("fp8_recipe", "= \"" + s.fp8_recipe + "\" is not \"delayed\", \"current\" or \"blockwise\"");
  for (const auto& [key, value] : *t) {
    static const char* const known[] = {"base", "name", "flash_attention", "dropout", "dp_overlap", "tp_overlap",
                                        "sequence_parallel", "zero_bubble", "max_zero", "grad_bytes", "recompute",
                                        "fp8_recipe", "no_recompute_slowdown", "attention_kernel"};
    if (std::find(std::begin(known), std::end(known), key.str()) == std::end(known))
      fail(std::string(key.str()), "is not a software profile key");
  }
  return s;
}

Software software_profile(const std::string& name_or_file) {
  if (!name_or_file.ends_with(".toml")) return named(name_or_file);
  std::ifstream in(name_or_file);
  if (!in) throw ConfigError("software profile file '" + name_or_file + "' cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return parse_software_profile(text.str(), name_or_file);
}

namespace {
// Each kernel's speed against FlashAttention-2 (Software::attention_kernel; the sources are in layout.h).
constexpr std::pair<const char*, double> kAttentionKernels[] = {{"flash2", 1.0}, {"triton", 1 / 1.8}};
}  // namespace

double Software::attention_speed() const {
  for (const auto& [name, speed] : kAttentionKernels)
    if (attention_kernel == name) return speed;
  throw ConfigError("internal: attention kernel \"" + attention_kernel + "\" has no speed");
}

void set_attention_kernel(Software& s, const std::string& kernel) {
  std::string valid;
  for (const auto& [name, speed] : kAttentionKernels) {
    if (kernel == name) {
      s.attention_kernel = kernel;
      return;
    }
    valid += (valid.empty() ? "" : ", ") + std::string(name);
  }
  throw ConfigError("\"" + kernel + "\" is not a known attention kernel (valid: " + valid + ")");
}

std::string describe(const Software& s) {
  const std::string attention = !s.flash_attention               ? "materialised"
                                : s.attention_kernel == "flash2" ? "flash"
                                                                 : "flash (" + s.attention_kernel + ")";
  return fmt::format("{} ({} attention{}, DP {}, TP {}, SP {}, ZeRO up to {}, recompute {}, gradients reduced in {} bytes, "
                     "fp8 {}{}{}{}{})",
                     s.profile, attention, s.dropout ? " with dropout" : "",
                     s.dp_overlap ? "overlapped" : "exposed", s.tp_overlap ? "overlapped (with SP)" : "exposed",
                     s.sequence_parallel ? "searched" : "never", s.max_zero,
                     s.recompute ? std::string(recompute_name(*s.recompute)) : "searched", s.grad_bytes, s.fp8_recipe,
                     s.zero_bubble ? ", zero-bubble pipeline" : "", s.loom_engine ? ", Loom's engine memory" : "",
                     s.comm_on_compute_cores ? ", collectives on the compute cores (never hidden)" : "",
                     s.no_recompute_slowdown > 0
                         ? fmt::format(", {:.0f}% slower without full recompute", 100 * s.no_recompute_slowdown)
                         : "");
}

}  // namespace loom::plan
