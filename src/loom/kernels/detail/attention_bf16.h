// Implementation detail of kernels/attention.cpp: the bf16 tile kernels (AVX512-BF16 dot products),
// defined in attention_bf16.cpp, which is compiled for that ISA: call them only where the CPU has it
// (CpuFeatures::kernel_isa() >= Avx512Bf16). Same work items, schedules and workspace contract as the
// f32 Simd<W> kernels in attention_simd.h; only the operands' precision and packing differ.
#pragma once

#include <cstdint>

#include "loom/kernels/detail/attention_tiles.h"

namespace loom::kernels::attention_detail {

int64_t bf16_forward_workspace_floats(int64_t Dp);
// Per thread; the by-kv-head schedule also packs its item's K, V, Q and dO of every tile up front.
int64_t bf16_backward_tile_floats(const Dims& s, bool by_kv_head);

// The forward's shared operands: K as bf16 rows and V as row pairs, every kv head of every batch row,
// packed by bf16_forward_pack for task = (b * KVH + g) * tiles + key tile, before any query tile runs.
int64_t bf16_forward_packed_floats(const Dims& s);
int64_t bf16_forward_pack_tasks(const Dims& s);
void bf16_forward_pack(const Dims& s, const float* qkv, float* packed, int64_t task);
// The tile kernels' pack (both amx_ and soft_amx_): V transposed, for their V^T P^T product.
void tiles_forward_pack(const Dims& s, const float* qkv, float* packed, int64_t task);

void bf16_forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b, int64_t h, int64_t i,
                             float* ws);
void bf16_backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g, int64_t j_begin, int64_t j_end,
                             float* dQ, float* Di_all, float* ws);
void bf16_backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i, float* ws);

// The same kernels with every matrix product on AMX tiles, 16 rows at a time (detail/tile_unit.h): the
// products whose A reads pairs across rows (P V, P^T dO, dS^T Q) run transposed (V^T P^T, dO^T P, Q^T
// dS) into transposed accumulators, with V, dO and Q packed transposed. `amx_` on the hardware -- only
// where amx_tiles_status().ready -- and `soft_amx_` on the software tile unit, which runs on any CPU
// with AVX512-BF16 so that the AMX kernels are tested everywhere. Same workspaces as bf16_; the pack
// step is tiles_forward_pack.
void amx_forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b, int64_t h, int64_t i,
                            float* ws);
void amx_backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g, int64_t j_begin, int64_t j_end,
                            float* dQ, float* Di_all, float* ws);
void amx_backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i, float* ws);
void soft_amx_forward_query_tile(const Dims& s, float* out, float* lse, const float* qkv, int64_t b, int64_t h,
                                 int64_t i, float* ws);
void soft_amx_backward_key_tiles(const Dims& s, const BackwardArgs& a, int64_t b, int64_t g, int64_t j_begin,
                                 int64_t j_end, float* dQ, float* Di_all, float* ws);
void soft_amx_backward_query_tile(const Dims& s, const BackwardArgs& a, int64_t b, int64_t h, int64_t i, float* ws);

}  // namespace loom::kernels::attention_detail
