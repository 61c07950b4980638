// Hardware descriptions for the planner: one device (peak FLOP/s per dtype, memory, bandwidth), how
// many sit in a node, the intra-node link and the inter-node network, plus the efficiency figures that
// turn peaks into achievable rates. Read from configs/hardware/*.toml; `loom calibrate` writes the same.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::plan {

// How a link's collectives take their latency steps (collective_cost.h): a ring, a 2-D torus, a switch
// (tree / NVLS), or one node's shared memory, where Loom's one-shot and direct algorithms have every rank
// read its peers' buffers in place: one synchronised step per phase whatever the group size.
enum class Topology { Ring, Torus, Switch, SharedMemory };
std::string_view topology_name(Topology t);

struct Link {
  double bandwidth = 0;  // bytes/s per device per direction (what a ring step can push)
  double latency = 0;    // seconds per message hop (alpha)
  Topology topology = Topology::Switch;
};

// How close real kernels and collectives get to the vendor peaks. One set per device, shared by every
// layout and every validation row (never tuned per row); docs/planner.md says where each comes from.
struct Efficiency {
  double gemm_max = 0.85;      // best fraction of peak a large GEMM reaches
  double gemm_half_dim = 96;   // a GEMM dimension of this size halves the efficiency it costs (d/(d+half))
  double memory = 0.80;        // fraction of memory bandwidth a streaming kernel reaches
  double link = 0.80;          // bus bandwidth a large collective reaches / link bandwidth
  // Compute runs this fraction slower while a collective overlaps it: on a GPU the collective's kernels
  // hold SMs and memory bandwidth, so "hidden" communication is not free (Lee et al. 2025, arXiv
  // 2507.03114: 18.9% mean compute slowdown under overlap on A100 / H100 / MI250 / MI210). Each second of
  // overlapped communication then costs this many seconds of the step. 0: overlap is free.
  double overlap_slowdown = 0;
};

struct DeviceSpec {
  std::string name;
  double peak_f32 = 0, peak_bf16 = 0, peak_fp8 = 0;  // FLOP/s (dense)
  double memory_bytes = 0;
  double memory_bandwidth = 0;  // bytes/s
  // FLOP/s Loom's own attention kernel reaches, forward + backward (measured by `loom calibrate`); 0:
  // not measured, attention runs as flash attention on the GEMM curve.
  double attention_flops = 0;
  // The same for its bf16 kernels (what bf16 and fp8 training run); 0: as attention_flops.
  double attention_bf16_flops = 0;
  double attention_rate(bool bf16) const { return bf16 && attention_bf16_flops > 0 ? attention_bf16_flops : attention_flops; }
};

// A GEMM shape measured on the device as a training step runs it (`loom calibrate --model`): the
// forward [M, N, K] with its two backward GEMMs (dX [M, K, N], dW [K, N, M]) at `bytes` per element
// (4 f32, 2 bf16); the rate is the three's FLOPs over their summed time. For that shape and element size
// the time model takes this rate instead of the efficiency curve: a curve fitted to square shapes
// misses the thin ones a narrow model's layers give.
// `ranks` > 1: the rate of one of that many ranks sharing the device (a CPU machine split among the
// ranks of one job), each on its share of the cores while the others run theirs (`loom calibrate`
// times it under `loom run -n ranks`); such entries describe the device only as shared that way
// (rank_share), and the time model reads the ranks = 1 entries.
struct MeasuredGemm {
  double M = 0, N = 0, K = 0, bytes = 2;
  double flops_per_s = 0;
  int ranks = 1;
};

// Loom's attention kernel timed at a model's own shape (`loom calibrate --model`): forward + backward
// FLOP/s by its declared costs, for B sequences of T tokens with `heads` query and `kv_heads` key/value
// heads of `head_dim` on a rank, `bytes` 2 for its bf16 kernels and 4 for f32. `ranks` as MeasuredGemm's.
// The rate moves with the shape (bf16 on the development EPYC, cold caches: ~275 GFLOP/s at T = 256, ~550
// at 1024),
// so the median of a few generic shapes had priced `mini`'s one-rank attention 28% fast.
struct MeasuredAttention {
  double B = 0, T = 0, heads = 0, kv_heads = 0, head_dim = 0, bytes = 2;
  double flops_per_s = 0;
  int ranks = 1;
};

struct Hardware {
  std::string name;    // short name, e.g. "h100"
  std::string source;  // where the figures came from (file, "calibrate", vendor docs)
  DeviceSpec device;
  int devices_per_node = 1;
  Link intra_node;
  Link inter_node;  // per device
  // Collectives on buffers the transport must stage through its shared arena (plain memory: a step's
  // activations under TP, CP, EP and between pipeline stages) where that differs from intra_node (whose
  // figures are for registered buffers, as data parallelism's gradients are): `loom calibrate` on a
  // CPU machine measures both. Bandwidth 0: as intra_node.
  Link staged_intra_node;
  const Link& intra_link(bool staged) const { return staged && staged_intra_node.bandwidth > 0 ? staged_intra_node : intra_node; }
  Efficiency efficiency;
  std::vector<MeasuredGemm> gemm_table;  // empty: the curve alone
  std::vector<MeasuredAttention> attention_table;  // empty: DeviceSpec::attention_rate alone

  double peak(const std::string& precision) const;  // "f32" | "bf16" | "fp8"; throws ConfigError
  // The attention kernel's rate at B sequences of T tokens, heads / kv_heads of head_dim on a rank: a
  // ranks = 1 attention_table entry of that T, heads, KV heads, head size and element size (the nearest
  // B, which moves the rate least), else DeviceSpec::attention_rate; 0 when neither was measured.
  double attention_rate(double B, double T, double heads, double kv_heads, double head_dim, bool bf16) const;
};

// One of `ranks` ranks sharing a one-device machine (a CPU machine whose cores a job's ranks split):
// its share of the peaks, of the memory bandwidth and of the memory; its GEMM table is the one timed
// per rank at that many ranks where the file has one (MeasuredGemm::ranks), else the whole device's
// rates shared out; its attention table likewise. The device itself for ranks <= 1, less the per-rank entries.
Hardware rank_share(const Hardware& machine, int ranks);

// A cluster: `count` devices of one kind.
struct Cluster {
  Hardware hw;
  int devices = 0;
  int nodes() const { return (devices + hw.devices_per_node - 1) / hw.devices_per_node; }
};

// Parses a hardware TOML document; `origin` names it in errors. Throws ConfigError on missing or
// invalid fields (naming the key and what would be valid).
Hardware parse_hardware(const std::string& toml_text, const std::string& origin);
Hardware load_hardware(const std::string& path);
// Writes `hw` in the format parse_hardware reads (round-trips). `section_notes` maps a section name
// ("device", "intra_node", ...) to comment lines written above it (e.g. "not measured").
std::string hardware_to_toml(const Hardware& hw, const std::string& header_comment,
                             const std::map<std::string, std::string>& section_notes = {});

// Resolves "NAME[:DEVICES]" or "PATH.toml[:DEVICES]": NAME is looked up as NAME.toml in `search_dirs`.
// DEVICES defaults to one node. Throws ConfigError listing the known names when nothing matches.
Cluster resolve_cluster(const std::string& spec, const std::vector<std::string>& search_dirs);
std::vector<std::string> known_hardware(const std::vector<std::string>& search_dirs);

}  // namespace loom::plan
