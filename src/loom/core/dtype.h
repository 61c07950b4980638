// Element types Loom stores and computes with. fp8 formats have room reserved but no kernels yet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

enum class DType : uint8_t { F32, BF16, I32, I64, F64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::F64: return 8;
  }
  return 0;
}

// Names as safetensors writes them ("F32", "BF16", ...).
std::string_view dtype_name(DType t);
// Parses "f32"/"F32"/"float32", "bf16"/"bfloat16", ...; throws ConfigError naming the valid choices.
DType parse_dtype(std::string_view s);

// Element i of a buffer of type t, as a double (tests, benchmarks and checks: not a hot path).
double load_element(const void* data, size_t i, DType t);
// Stores v (rounded to nearest for bf16, truncated for integers) as element i.
void store_element(void* data, size_t i, DType t, double v);

}  // namespace loom
