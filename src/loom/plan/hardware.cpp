#include "loom/plan/hardware.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <type_traits>
#include <toml++/toml.h>

#include "loom/core/toml_text.h"
#include "loom/error.h"

namespace loom::plan {

namespace fs = std::filesystem;

std::string_view topology_name(Topology t) {
  switch (t) {
    case Topology::Ring: return "ring";
    case Topology::Torus: return "torus";
    case Topology::Switch: return "switch";
    case Topology::SharedMemory: return "shared_memory";
  }
  return "?";
}

double Hardware::peak(const std::string& precision) const {
  double p = precision == "bf16" ? device.peak_bf16
             : precision == "fp8" ? device.peak_fp8
             : precision == "f32" ? device.peak_f32
                                  : -1;
  if (p < 0) throw ConfigError("precision '" + precision + "' is not known (valid: bf16, fp8, f32)");
  if (p <= 0) throw ConfigError("hardware '" + name + "' has no " + precision + " peak (set device.peak_tflops." + precision + ")");
  return p;
}

Hardware rank_share(const Hardware& machine, int ranks) {
  Hardware hw = machine;
  if (ranks <= 1) return hw;
  const double w = ranks;
  hw.device.peak_f32 /= w, hw.device.peak_bf16 /= w, hw.device.peak_fp8 /= w;
  hw.device.attention_flops /= w, hw.device.attention_bf16_flops /= w;
  hw.device.memory_bandwidth /= w, hw.device.memory_bytes /= w;
  hw.devices_per_node = ranks;
  // A rank runs its GEMMs on its share of the cores, which is not the whole machine's rate shared out
  // (one thread each of two ranks beat half the two-thread rate by 7-17% on llama-mini's shapes):
  // the per-rank table where it was timed, else the whole device's rates shared out.
  auto share_table = [&](auto& table, const auto& whole) {
    std::remove_cvref_t<decltype(table)> per_rank;
    for (const auto& g : whole)
      if (g.ranks == ranks) per_rank.push_back(g), per_rank.back().ranks = 1;
    std::erase_if(table, [](const auto& g) { return g.ranks != 1; });
    if (per_rank.empty())
      for (auto& g : table) g.flops_per_s /= w;
    else
      table = per_rank;
  };
  share_table(hw.gemm_table, machine.gemm_table);
  share_table(hw.attention_table, machine.attention_table);
  return hw;
}

double Hardware::attention_rate(double B, double T, double heads, double kv_heads, double head_dim, bool bf16) const {
  const double bytes = bf16 ? 2 : 4;
  const MeasuredAttention* best = nullptr;
  for (const auto& a : attention_table)
    if (a.ranks == 1 && a.bytes == bytes && a.T == T && a.heads == heads && a.kv_heads == kv_heads &&
        a.head_dim == head_dim && (!best || std::abs(std::log(a.B / B)) < std::abs(std::log(best->B / B))))
      best = &a;
  return best ? best->flops_per_s : device.attention_rate(bf16);
}

namespace {

// Far above any real device, link or efficiency figure in its file unit (TFLOP/s, GiB, GB/s, us).
constexpr double kMaxFigure = 1e12;

struct Reader {
  const toml::table& root;
  const std::string& origin;

  const toml::node* find(const std::string& path) const {
    auto v = root.at_path(path);
    return v.node();
  }
  double number(const std::string& path, bool required = true, double fallback = 0) const {
    const toml::node* n = find(path);
    if (!n) {
      if (required) throw ConfigError(origin + ": missing '" + path + "' (a number)");
      return fallback;
    }
    if (auto d = n->value<double>()) {
      // A bound keeps every scaled figure (x 1e12 for TFLOP/s) finite, so it prints and parses back.
      if (!(*d >= 0 && *d <= kMaxFigure))
        throw ConfigError(fmt::format("{}: '{}' = {} must be a number in [0, {:g}]", origin, path, *d, kMaxFigure));
      return *d;
    }
    throw ConfigError(origin + ": '" + path + "' must be a number");
  }
  std::string string(const std::string& path, const std::string& fallback) const {
    const toml::node* n = find(path);
    if (!n) return fallback;
    if (auto s = n->value<std::string>()) return *s;
    throw ConfigError(origin + ": '" + path + "' must be a string");
  }
  Topology topology(const std::string& path) const {
    std::string t = string(path, "switch");
    if (t == "ring") return Topology::Ring;
    if (t == "torus") return Topology::Torus;
    if (t == "switch") return Topology::Switch;
    if (t == "shared_memory") return Topology::SharedMemory;
    throw ConfigError(origin + ": '" + path + "' = '" + t + "' is not known (valid: ring, torus, switch, shared_memory)");
  }
};

// One row of a measured table ([[gemm_table]], [[attention_table]]): its positive number fields and its
// optional `ranks`, each error naming the row.
struct MeasuredRow {
  const toml::table& row;
  std::string where;
  double field(const char* key) const {
    const auto v = row.get(key) ? row.get(key)->value<double>() : std::nullopt;
    if (!v || !std::isfinite(*v) || *v <= 0 || *v > kMaxFigure)
      throw ConfigError(fmt::format("{}: '{}' must be a positive number", where, key));
    return *v;
  }
  int ranks() const {
    const toml::node* r = row.get("ranks");
    if (!r) return 1;
    const auto v = r->value_exact<int64_t>();
    if (!v || *v < 1 || *v > 65536)
      throw ConfigError(where + ": 'ranks' must be an integer in [1, 65536] (the ranks sharing the device "
                                "when the rate was timed per rank)");
    return static_cast<int>(*v);
  }
};

template <class Row>
void for_each_measured_row(const toml::table& root, const char* key, const char* fields, const std::string& origin,
                           Row&& row) {
  const toml::node* t = root.get(key);
  if (!t) return;
  const toml::array* rows = t->as_array();
  if (!rows) throw ConfigError(fmt::format("{}: '{}' must be an array of tables ([[{}]])", origin, key, key));
  for (size_t i = 0; i < rows->size(); ++i) {
    const std::string where = fmt::format("{}: {}[{}]", origin, key, i);
    const toml::table* r = (*rows)[i].as_table();
    if (!r) throw ConfigError(fmt::format("{} must be a table with {}", where, fields));
    row(MeasuredRow{*r, where});
  }
}

}  // namespace

Hardware parse_hardware(const std::string& text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}: line {}: {}", origin, e.source().begin.line, e.description()));
  }
  Reader r{root, origin};
  Hardware hw;
  hw.name = r.string("name", fs::path(origin).stem().string());
  hw.source = r.string("source", origin);
  hw.device.name = r.string("device.name", hw.name);
  constexpr double T = 1e12, G = 1e9;
  hw.device.peak_bf16 = r.number("device.peak_tflops.bf16") * T;
  hw.device.peak_fp8 = r.number("device.peak_tflops.fp8", false) * T;
  hw.device.peak_f32 = r.number("device.peak_tflops.f32", false) * T;
  hw.device.memory_bytes = r.number("device.memory_GiB") * double(1ull << 30);
  hw.device.memory_bandwidth = r.number("device.memory_bandwidth_GBps") * G;
  hw.device.attention_flops = r.number("device.attention_tflops", false) * T;
  if (hw.device.attention_flops < 0) throw ConfigError(origin + ": 'device.attention_tflops' must not be negative");
  hw.device.attention_bf16_flops = r.number("device.attention_bf16_tflops", false) * T;
  if (hw.device.attention_bf16_flops < 0)
    throw ConfigError(origin + ": 'device.attention_bf16_tflops' must not be negative");
  double per_node = r.number("node.devices");
  if (per_node < 1 || per_node > (1 << 20) || per_node != std::floor(per_node))  // checked before the cast to int
    throw ConfigError(fmt::format("{}: 'node.devices' = {} must be a positive integer", origin, per_node));
  hw.devices_per_node = static_cast<int>(per_node);
  hw.intra_node = {r.number("intra_node.bandwidth_GBps") * G, r.number("intra_node.latency_us") * 1e-6,
                   r.topology("intra_node.topology")};
  hw.inter_node = {r.number("inter_node.bandwidth_GBps") * G, r.number("inter_node.latency_us") * 1e-6,
                   Topology::Switch};
  if (root.get("staged_intra_node")) {
    hw.staged_intra_node = {r.number("staged_intra_node.bandwidth_GBps") * G,
                            r.number("staged_intra_node.latency_us") * 1e-6, hw.intra_node.topology};
    if (hw.staged_intra_node.bandwidth <= 0 || hw.staged_intra_node.latency < 0)
      throw ConfigError(origin + ": 'staged_intra_node' needs a positive bandwidth_GBps and a latency_us >= 0");
  }
  Efficiency e;
  e.gemm_max = r.number("efficiency.gemm_max", false, e.gemm_max);
  e.gemm_half_dim = r.number("efficiency.gemm_half_dim", false, e.gemm_half_dim);
  e.memory = r.number("efficiency.memory", false, e.memory);
  e.link = r.number("efficiency.link", false, e.link);
  e.overlap_slowdown = r.number("efficiency.overlap_slowdown", false, e.overlap_slowdown);
  for (double f : {e.gemm_max, e.memory, e.link})
    if (f <= 0 || f > 1) throw ConfigError(origin + ": efficiency figures must lie in (0, 1]");
  if (e.overlap_slowdown < 0 || e.overlap_slowdown > 1)
    throw ConfigError(fmt::format("{}: 'efficiency.overlap_slowdown' = {} must lie in [0, 1] (the fraction by which "
                                  "compute slows while a collective overlaps it)", origin, e.overlap_slowdown));
  hw.efficiency = e;
  for_each_measured_row(root, "gemm_table", "m, n, k, bytes and tflops", origin, [&](const MeasuredRow& r) {
    MeasuredGemm g{r.field("m"), r.field("n"), r.field("k"), r.field("bytes"), r.field("tflops") * T, r.ranks()};
    if (g.bytes != 1 && g.bytes != 2 && g.bytes != 4) throw ConfigError(r.where + ": 'bytes' must be 1, 2 or 4");
    hw.gemm_table.push_back(g);
  });
  for_each_measured_row(root, "attention_table", "b, t, heads, kv_heads, head_dim, bytes and tflops", origin,
                        [&](const MeasuredRow& r) {
    MeasuredAttention a{r.field("b"),        r.field("t"),     r.field("heads"),          r.field("kv_heads"),
                        r.field("head_dim"), r.field("bytes"), r.field("tflops") * T, r.ranks()};
    if (a.bytes != 2 && a.bytes != 4) throw ConfigError(r.where + ": 'bytes' must be 2 (bf16 kernels) or 4 (f32)");
    if (std::fmod(a.heads, a.kv_heads) != 0)
      throw ConfigError(fmt::format("{}: heads = {} must be a multiple of kv_heads = {}", r.where, a.heads, a.kv_heads));
    hw.attention_table.push_back(a);
  });
  if (hw.device.peak_bf16 <= 0 || hw.device.memory_bytes <= 0 || hw.device.memory_bandwidth <= 0 ||
      hw.intra_node.bandwidth <= 0 || hw.inter_node.bandwidth <= 0)
    throw ConfigError(origin + ": peaks, memory, bandwidths must be positive");
  return hw;
}

Hardware load_hardware(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot read hardware file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hardware(ss.str(), path);
}

std::string hardware_to_toml(const Hardware& hw, const std::string& header,
                             const std::map<std::string, std::string>& notes) {
  auto comment = [](const std::string& text) {
    std::string out;
    std::istringstream lines(text);
    for (std::string l; std::getline(lines, l);) out += "# " + l + "\n";
    return out;
  };
  auto section = [&](const std::string& name) {
    auto it = notes.find(name);
    return (it == notes.end() ? std::string() : comment(it->second)) + "[" + name + "]\n";
  };
  std::string out = comment(header);
  const double T = 1e12, G = 1e9;
  out += fmt::format("name = {}\nsource = {}\n\n", toml_basic_string(hw.name), toml_basic_string(hw.source));
  out += section("device");
  out += fmt::format("name = {}\nmemory_GiB = {:.6g}\nmemory_bandwidth_GBps = {:.6g}\n", toml_basic_string(hw.device.name),
                     hw.device.memory_bytes / double(1ull << 30), hw.device.memory_bandwidth / G);
  out += fmt::format("peak_tflops = {{ bf16 = {:.6g}, fp8 = {:.6g}, f32 = {:.6g} }}\n", hw.device.peak_bf16 / T,
                     hw.device.peak_fp8 / T, hw.device.peak_f32 / T);
  if (hw.device.attention_flops > 0) out += fmt::format("attention_tflops = {:.6g}\n", hw.device.attention_flops / T);
  if (hw.device.attention_bf16_flops > 0)
    out += fmt::format("attention_bf16_tflops = {:.6g}\n", hw.device.attention_bf16_flops / T);
  out += "\n";
  out += section("node") + fmt::format("devices = {}\n\n", hw.devices_per_node);
  out += section("intra_node") + fmt::format("bandwidth_GBps = {:.6g}\nlatency_us = {:.6g}\ntopology = \"{}\"\n\n",
                                             hw.intra_node.bandwidth / G, hw.intra_node.latency * 1e6,
                                             topology_name(hw.intra_node.topology));
  if (hw.staged_intra_node.bandwidth > 0)
    out += section("staged_intra_node") + fmt::format("bandwidth_GBps = {:.6g}\nlatency_us = {:.6g}\n\n",
                                                      hw.staged_intra_node.bandwidth / G,
                                                      hw.staged_intra_node.latency * 1e6);
  out += section("inter_node") + fmt::format("bandwidth_GBps = {:.6g}\nlatency_us = {:.6g}\n\n",
                                             hw.inter_node.bandwidth / G, hw.inter_node.latency * 1e6);
  out += section("efficiency") + fmt::format("gemm_max = {:.4g}\ngemm_half_dim = {:.4g}\nmemory = {:.4g}\nlink = {:.4g}\n",
                                             hw.efficiency.gemm_max, hw.efficiency.gemm_half_dim,
                                             hw.efficiency.memory, hw.efficiency.link);
  if (hw.efficiency.overlap_slowdown > 0)
    out += fmt::format("overlap_slowdown = {:.4g}\n", hw.efficiency.overlap_slowdown);
  if (!hw.gemm_table.empty()) {
    out += "\n" + comment(notes.count("gemm_table") ? notes.at("gemm_table") : std::string("GEMM shapes measured as a training step runs them (forward + both backward GEMMs)."));
    for (const auto& g : hw.gemm_table)
      out += fmt::format("[[gemm_table]]\nm = {:.0f}\nn = {:.0f}\nk = {:.0f}\nbytes = {:.0f}\ntflops = {:.6g}\n{}", g.M, g.N,
                         g.K, g.bytes, g.flops_per_s / T, g.ranks > 1 ? fmt::format("ranks = {}\n", g.ranks) : "");
  }
  if (!hw.attention_table.empty()) {
    out += "\n" + comment(notes.count("attention_table") ? notes.at("attention_table")
                                                        : std::string("Loom's attention kernel at a model's own shapes (forward + backward)."));
    for (const auto& a : hw.attention_table)
      out += fmt::format("[[attention_table]]\nb = {:.0f}\nt = {:.0f}\nheads = {:.0f}\nkv_heads = {:.0f}\nhead_dim = {:.0f}\n"
                         "bytes = {:.0f}\ntflops = {:.6g}\n{}",
                         a.B, a.T, a.heads, a.kv_heads, a.head_dim, a.bytes, a.flops_per_s / T,
                         a.ranks > 1 ? fmt::format("ranks = {}\n", a.ranks) : "");
  }
  return out;
}

std::vector<std::string> known_hardware(const std::vector<std::string>& dirs) {
  std::vector<std::string> names;
  for (auto& d : dirs) {
    std::error_code ec;
    for (auto& e : fs::directory_iterator(d, ec))
      if (e.path().extension() == ".toml") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

Cluster resolve_cluster(const std::string& spec, const std::vector<std::string>& dirs) {
  std::string name = spec;
  int devices = 0;
  if (auto colon = spec.rfind(':'); colon != std::string::npos) {
    name = spec.substr(0, colon);
    std::string n = spec.substr(colon + 1);
    try {
      size_t used = 0;
      devices = std::stoi(n, &used);
      if (used != n.size() || devices < 1) throw std::invalid_argument(n);
    } catch (const std::out_of_range&) {
      throw ConfigError("--cluster '" + spec + "': device count '" + n + "' is too large (at most " +
                        std::to_string(std::numeric_limits<int>::max()) + ")");
    } catch (const std::exception&) {
      throw ConfigError("--cluster '" + spec + "': device count '" + n + "' must be a positive integer");
    }
  }
  std::string path;
  if (name.size() > 5 && name.ends_with(".toml")) {
    path = name;
  } else {
    for (auto& d : dirs)
      if (fs::exists(fs::path(d) / (name + ".toml"))) {
        path = (fs::path(d) / (name + ".toml")).string();
        break;
      }
  }
  if (path.empty()) {
    std::string valid;
    for (auto& n : known_hardware(dirs)) valid += (valid.empty() ? "" : ", ") + n;
    throw ConfigError("unknown cluster '" + name + "' (valid: " + (valid.empty() ? "none found" : valid) +
                      "; or a path to a hardware .toml, optionally followed by :DEVICES)");
  }
  Cluster c{load_hardware(path), devices};
  if (c.devices == 0) c.devices = c.hw.devices_per_node;
  return c;
}

}  // namespace loom::plan
