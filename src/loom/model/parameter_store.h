// ParameterStore: the model's parameters, gradients and (in bf16 mode) bf16 compute copies, each in
// one contiguous arena laid out by the spec's parameter table. Views are looked up by name, so the
// table is the only description of what exists and where.
#pragma once

#include <cstdint>
#include <string>

#include "loom/core/tensor.h"
#include "loom/spec/param_table.h"

namespace loom::model {

// fp32: everything in f32. bf16: GEMMs read bf16 copies of weights and activations and accumulate in
// f32; master weights, gradients and optimizer state stay f32.
enum class Precision { FP32, BF16 };
Precision parse_precision(const std::string& s);
const char* precision_name(Precision p);

class ParameterStore {
 public:
  ParameterStore(spec::ParamTable table, Precision precision, Allocator& alloc);

  const spec::ParamTable& table() const { return table_; }
  Precision precision() const { return precision_; }
  const Tensor& master() const { return master_; }  // f32 [total]
  const Tensor& grads() const { return grads_; }    // f32 [total]
  const Tensor& lowp() const { return lowp_; }      // bf16 [total], only in bf16 mode

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
  // sharding or thread count.
  void initialize(uint64_t seed);
  // Refreshes the bf16 copies from the masters (the optimizer does this fused with its update).
  void refresh_lowp();
  void zero_grads();

 private:
  Tensor view_of(const Tensor& arena, const spec::ParamSpec& p) const;
  Tensor rows_of(const Tensor& arena, const std::string& first, const std::string& last) const;

  spec::ParamTable table_;
  Precision precision_;
  Tensor master_, grads_, lowp_;
};

}  // namespace loom::model
