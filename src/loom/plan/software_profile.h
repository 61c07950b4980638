// Software profiles: the assumptions a prediction makes about the training stack, named and fixed
// together instead of left implicit -- whether attention is flash (no T x T scores), dropout, whether
// the data-parallel gradient reduction overlaps backward, whether TP/SP collectives overlap GEMMs,
// whether the stack has sequence parallelism, the recompute policy it runs, the gradient reduction's
// bytes, and the fp8 recipe. Predictions at a fixed layout move by 10-15% with these, so every
// prediction prints the profile it used (describe()).
//
//   megatron       Megatron-Core today (default): flash attention, no dropout, DDP overlapped in
//                  buckets, TP exposed (--tp-overlap to overlap), SP and recompute searched, fp32
//                  gradient reduction, delayed fp8 scaling (Transformer Engine).
//   megatron-2021  Megatron-LM as the 2021-22 papers ran it (the validation rows): materialised
//                  attention scores, dropout, the "local" DDP's fp32 all-reduce after backward, no
//                  distributed optimizer (ZeRO 0).
//   deepspeed      DeepSpeed ZeRO (Megatron-DeepSpeed): flash attention, no Megatron SP, gradients
//                  reduced in the 16-bit model dtype, overlapped.
//   neuron         NeuronX Distributed on Trainium: flash (NKI) attention, SP with tp, overlapped DDP,
//                  TP exposed, fp32 gradient reduction, its ZeRO-1 optimizer (no ZeRO-2/3).
//   loom           Loom's own engine: its memory conventions (exact against measured runs), the layouts
//                  it runs, fp32 gradient buckets reduced during backward.
//
// A custom profile is a TOML file with a [software] table: `base` (a named profile to start from) and
// any of name, flash_attention, dropout, dp_overlap, tp_overlap, sequence_parallel (booleans),
// max_zero (0-3), grad_bytes (2 or 4), recompute ("search", "none", "selective", "full"), fp8_recipe ("delayed",
// "current", "blockwise"), no_recompute_slowdown (0-1), attention_kernel ("flash2", "triton"; flash only).
//
//   pytorch-fsdp   PyTorch FSDP stacks (Composer / llm-foundry, fms-fsdp): flash (SDPA) attention, no TP
//                  or SP, fp32 gradient reduction, overlapped; runs without full activation recompute
//                  15% slower than their kernels' sum (fitted, Software::no_recompute_slowdown).
//                  llm-foundry's MPT runs its Triton FlashAttention: attention_kernel = "triton".
#pragma once

#include <string>
#include <vector>

#include "loom/plan/layout.h"

namespace loom::plan {

std::vector<std::string> software_profile_names();
// A named profile, or a .toml file's. Throws ConfigError naming the profile, file or key.
Software software_profile(const std::string& name_or_file);
Software parse_software_profile(const std::string& toml_text, const std::string& origin);
// One line: "megatron (flash attention, DP overlapped, TP exposed, SP searched, ZeRO up to 3, recompute
// searched, gradients reduced in 4 bytes, fp8 delayed)".
std::string describe(const Software& s);

}  // namespace loom::plan
