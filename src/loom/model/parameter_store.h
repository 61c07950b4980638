// ParameterStore: the model's parameters, gradients and (in bf16 mode) bf16 compute copies, each in
// one contiguous arena laid out by the spec's parameter table. Views are looked up by name, so the
// table is the only description of what exists and where.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "loom/core/page_reservation.h"
#include "loom/core/tensor.h"
#include "loom/spec/param_table.h"

namespace loom::model {

// fp32: everything in f32. bf16: GEMMs read bf16 copies of weights and activations and accumulate in
// f32; master weights, gradients and optimizer state stay f32.
enum class Precision { FP32, BF16 };
Precision parse_precision(const std::string& s);
const char* precision_name(Precision p);

// Which arenas are reserved address space backed only where written (ZeRO-3's weights, ZeRO-1/2's f32
// masters in bf16 mode, ZeRO-2's and -3's gradients) instead of allocated whole. Their bytes are not charged to the Allocator here: the
// ZeRO engine charges what it keeps resident.
struct ArenaBacking {
  bool master_on_demand = false;  // f32 masters
  bool lowp_on_demand = false;    // bf16 copies
  bool grads_on_demand = false;
  // Memory for the gradient arena provided by the caller (the dp group's registered communication
  // memory, which collectives read in place): total_numel() floats that outlive the store. Zeroed
  // here, not charged here.
  float* grads_memory = nullptr;
};

// Where the weights live. F32Masters: f32 masters (and in bf16 mode bf16 copies the GEMMs read).
// Bf16Only (precision = "bf16-pure"): one bf16 arena is the weights, read by every kernel; no f32
// master exists, so updates must round stochastically to make progress below bf16's resolution.
enum class WeightStorage { F32Masters, Bf16Only };

class ParameterStore {
 public:
  ParameterStore(spec::ParamTable table, Precision precision, Allocator& alloc, ArenaBacking backing = {},
                 WeightStorage storage = WeightStorage::F32Masters);

  const spec::ParamTable& table() const { return table_; }
  Precision precision() const { return precision_; }
  const Tensor& master() const { return master_; }  // f32 [total]; undefined under Bf16Only
  const Tensor& grads() const { return grads_; }    // f32 [total]
  const Tensor& lowp() const { return lowp_; }      // bf16 [total], only in bf16 mode (the weights under Bf16Only)
  bool bf16_only() const { return storage_ == WeightStorage::Bf16Only; }
  // The weights' arena, whatever it holds: the f32 masters, or under Bf16Only the bf16 weights.
  const Tensor& weights() const { return bf16_only() ? lowp_ : master_; }

  // Weights of arena elements [begin, begin + n) as f32 (widened exactly under Bf16Only), and written
  // from f32 (rounded to nearest under Bf16Only, exact for values that came from bf16): what
  // checkpoints and interchange formats read and write.
  void read_f32(int64_t begin, int64_t n, float* out) const;
  void write_f32(int64_t begin, int64_t n, const float* in);

  // The weights (f32 master, or the bf16 weights under Bf16Only: kernels take either).
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  // The tensor GEMMs read: the bf16 copy in bf16 mode, else the f32 master.
  Tensor compute(const std::string& name) const;
  // Parameters first..last (in table order) seen as one matrix: q/k/v or gate/up become one GEMM.
  // Throws if they are not adjacent in the arena.
  Tensor param_rows(const std::string& first, const std::string& last) const;
  Tensor grad_rows(const std::string& first, const std::string& last) const;
  Tensor compute_rows(const std::string& first, const std::string& last) const;

  // Each element from Philox(seed, stream_of(name), element index): the same value whatever the
  // sharding or thread count. `only`: initialise just these arena ranges (a ZeRO-3 rank's shard; the
  // rest stays unbacked); empty means all.
  void initialize(uint64_t seed, std::span<const spec::ArenaRange> only = {});
  // Refreshes the bf16 copies from the masters (the optimizer does this fused with its update);
  // `only` as for initialize. Rounds to nearest even, or, once stochastic rounding is on and an update
  // was made, stochastically under the key of the last update (set_rounding_step): the copy is then
  // the one the update wrote, on every layout.
  void refresh_lowp(std::span<const spec::ArenaRange> only = {});
  // precision = "bf16-sr": the bf16 copies of updated weights are rounded stochastically, keyed by
  // (seed, update step, parameter, global element) -- kernels::StochasticRounding.
  void use_stochastic_rounding(uint64_t seed) { sr_seed_ = seed, sr_ = true; }
  bool stochastic_rounding() const { return sr_; }
  void set_rounding_step(int64_t step) { rounding_step_ = step; }
  // The Philox key of the current rounding step and the stream of a parameter's weights: what every
  // stochastic rounding of weights (bf16-sr's copies, bf16-pure's updates) draws from.
  uint64_t rounding_key() const;
  static uint64_t rounding_stream(const std::string& name);
  // Writes the bf16 copies of arena ranges `ranges` from the masters, stochastically under the
  // current rounding step when that is on (what the optimizer calls after its update).
  void write_lowp(std::span<const spec::ArenaRange> ranges);
  void zero_grads();

  // The on-demand arenas' reservations (nullptr where the arena is allocated whole).
  PageReservation* master_pages() { return master_pages_.get(); }
  PageReservation* lowp_pages() { return lowp_pages_.get(); }
  PageReservation* grad_pages() { return grad_pages_.get(); }

 private:
  Tensor view_of(const Tensor& arena, const spec::ParamSpec& p) const;
  Tensor rows_of(const Tensor& arena, const std::string& first, const std::string& last) const;

  spec::ParamTable table_;
  Precision precision_;
  WeightStorage storage_;
  bool sr_ = false;
  uint64_t sr_seed_ = 0;
  int64_t rounding_step_ = 0;
  Tensor master_, grads_, lowp_;
  std::unique_ptr<PageReservation> master_pages_, lowp_pages_, grad_pages_;
};

}  // namespace loom::model
