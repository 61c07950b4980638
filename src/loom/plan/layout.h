// A parallel layout (how one training step is spread over devices) and the job it serves, plus the
// divisibility / batch rules a layout must satisfy. Mesh order, innermost first: tp, cp, dp, pp (tp
// inside a node, as Megatron-LM and TorchTitan place it); ep is drawn from dp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/plan/hardware.h"
#include "loom/plan/model_zoo.h"
#include "loom/spec/recompute.h"

namespace loom::plan {

using spec::Recompute;
using spec::recompute_name;
enum class Schedule { GPipe, OneFOneB, Interleaved, ZeroBubble };
std::string_view schedule_name(Schedule s);

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  int vpp = 1;              // virtual stages per device (interleaved schedule); 1 otherwise
  int micro_batch = 1;      // sequences per micro-batch per dp rank
  int zero = 0;             // ZeRO stage 0..3 over dp
  bool sp = false;          // sequence parallelism (needs tp > 1)
  Recompute recompute = Recompute::None;
  Schedule schedule = Schedule::OneFOneB;
  bool cp_all_to_all = false;  // cp by all-to-all (Ulysses: heads split over cp) instead of the ring

  int devices() const { return dp * tp * pp * cp; }
  std::string str() const;  // "dp4 tp8 pp2 v3 mb1 z1 sel sp"
};

// The software being modelled: what overlaps with what, which attention kernel. The defaults are
// Megatron-Core's today; named profiles (plan/software_profile.h: megatron, megatron-2021, deepspeed,
// neuron, loom, or a TOML) fix every field, and each prediction prints the profile it used.
struct Software {
  std::string profile = "megatron";  // the profile's name, printed with every prediction
  bool flash_attention = true;  // false: the T x T scores are written to memory (Megatron 2021-22)
  // Which flash-attention kernel (set_attention_kernel); attention_speed() is its speed relative to
  // FlashAttention-2, what the GEMM curve prices.
  std::string attention_kernel = "flash2";
  double attention_speed() const;
  bool dropout = false;         // dropout after attention and MLP (masks stored, bytes moved)
  bool dp_overlap = true;       // gradient reduction overlaps the last micro-batch's backward
  bool tp_overlap = false;      // TP/SP collectives overlap GEMMs (none do here: exposed)
  // The collectives move and sum data with the cores that compute (a CPU machine shared by its
  // ranks): hiding them under compute only takes the compute's cycles, so the data-parallel
  // reduction, ZeRO-3's gathers and TP's collectives are priced in full, never overlapped.
  bool comm_on_compute_cores = false;
  double grad_bytes = 4;        // gradients are accumulated and reduced in fp32
  bool sequence_parallel = true;  // the search may turn SP on with tp (false: the software has no SP)
  int max_zero = 3;               // the highest ZeRO stage the software shards to (0: plain DDP)
  // The software runs a zero-bubble pipeline schedule (ZB-H1): Loom does; Megatron-Core, NeMo, NxD,
  // DeepSpeed and FSDP stacks run (interleaved) 1F1B and GPipe.
  bool zero_bubble = false;
  // Activation recompute: the search picks (unset), or the software always runs this policy.
  std::optional<Recompute> recompute;
  // fp8 runs: "delayed" or "blockwise" scaling (amaxes kept or taken per block in the cast pass) or
  // "current" (a separate amax pass: each quantised input is read once more).
  std::string fp8_recipe = "delayed";
  // MoE routing imbalance: the busiest expert-parallel rank's routed tokens over the mean (1: uniform).
  // Every rank waits for the busiest in the all-to-alls, so expert GEMMs, their activations and the
  // dispatch traffic are sized by it.
  double moe_imbalance = 1.0;
  // Memory as Loom's own engine holds it (engine_memory.h: f32 masters, its activation buffers, its
  // ZeRO units) instead of Megatron-LM's conventions; only layouts the engine runs (dp x ZeRO).
  bool loom_engine = false;
  // Loom's engine reduces data-parallel gradients in buckets of this many bytes (parallel.bucket_kb;
  // 0: one collective after backward), and ZeRO's per unit (the embeddings, each block, the final norm
  // and head): one collective each, each paying the link's latency.
  double dp_bucket_bytes = 4 << 20;
  // precision = "bf16-pure": weights and Adam moments held in bf16 only (no fp32 master): 2 + 4 bytes of
  // state per parameter instead of 2 + 12 (gradients stay fp32).
  bool bf16_weights_only = false;
  // Under pp, blocks per chunk (`--pipeline-layers`, the engine's parallel.pipeline.layers): real runs
  // take a layer or two off the first and last stages (126 layers on 16 stages: 7, 14 x 8, 7). Only
  // layouts with that many chunks are then searched. Empty: an even split (Megatron), or balanced by
  // cost as the engine cuts.
  std::vector<int64_t> pipeline_layers;
  // Without full activation recompute (none or selective), every pass of a micro-batch through the
  // blocks runs this fraction slower than its kernels' sum. PyTorch FSDP stacks (eager autograd
  // holding every op's saved tensors in the caching allocator) publish MFU without checkpointing at or
  // below their MFU with it (MosaicML's sweep: 13B on A100, 59.6% without, 59.5% with), which a full
  // recompute's extra forward cannot give unless the run without it is slower per FLOP. Fitted per
  // profile on the in-sample rows (`--validate` prints the fit); 0 for the Megatron-family stacks,
  // whose rows do not call for it.
  double no_recompute_slowdown = 0;
};

// Sets Software::attention_kernel and its speed: "flash2" (1: FlashAttention-2 and kernels of its class:
// PyTorch SDPA, Megatron-Core and NeMo on A100), or "triton" (1 / 1.8: the Triton FlashAttention of 2022
// that llm-foundry's MPT runs to take ALiBi's bias; the FlashAttention-2 paper, Dao 2023, section 4.1,
// measures FA2 1.3-2.5x faster than it, and 1.8 is that range's geometric mean, not fitted to any
// row). Throws ConfigError naming the valid kernels.
void set_attention_kernel(Software& s, const std::string& kernel);

struct Job {
  PlanModel model;
  Cluster cluster;
  int64_t seq = 2048;
  int64_t global_batch = 512;  // sequences per step
  std::string precision = "bf16";  // GEMM precision: bf16 | fp8
  Software software;
  double memory_margin = 0.10;  // fraction of device memory kept free (allocator fragmentation, runtime, NCCL)
};

// Validates the job itself (seq within the model, batch positive, ...). Throws ConfigError.
void check_job(const Job& job);

enum class Reject { None, Divisibility, Batch, Memory, Engine };
std::string_view reject_name(Reject r);
struct Verdict {
  Reject reject = Reject::None;
  std::string why;
  bool ok() const { return reject == Reject::None; }
};
// Divisibility and batch rules (not memory): heads and KV heads and d_ff by tp, layers by pp * vpp,
// seq by cp, experts by ep, devices = dp*tp*pp*cp, global batch by dp * micro_batch, ...
Verdict check_layout(const Layout& l, const Job& job);

// The blocks per pipeline chunk the layout runs: the job's explicit cut (--pipeline-layers), or, when
// pp does not divide the blocks and each stage runs one chunk, the ends trimmed (spec::trimmed_ends:
// the Megatron-family profiles; Loom's engine balances by cost); empty for an even split.
std::vector<int64_t> pipeline_cut(const Layout& l, const Job& job);

// Micro-batches per step per pipeline.
inline int64_t micro_batches(const Layout& l, const Job& j) { return j.global_batch / (int64_t(l.dp) * l.micro_batch); }

}  // namespace loom::plan
