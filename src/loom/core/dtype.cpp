#include "loom/core/dtype.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "loom/core/bf16.h"
#include "loom/error.h"

namespace loom {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::F64: return "F64";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  std::string l(s);
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l == "f32" || l == "float32" || l == "fp32") return DType::F32;
  if (l == "bf16" || l == "bfloat16") return DType::BF16;
  if (l == "i32" || l == "int32") return DType::I32;
  if (l == "i64" || l == "int64") return DType::I64;
  if (l == "f64" || l == "float64" || l == "fp64") return DType::F64;
  throw ConfigError("unsupported dtype '" + std::string(s) + "' (valid: f32, bf16, i32, i64, f64)");
}

double load_element(const void* data, size_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(data)[i];
    case DType::F64: return static_cast<const double*>(data)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const bf16*>(data)[i]);
    case DType::I32: return static_cast<const int32_t*>(data)[i];
    case DType::I64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
  }
  return 0;
}

void store_element(void* data, size_t i, DType t, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(data)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(data)[i] = v; break;
    case DType::BF16: static_cast<bf16*>(data)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DType::I32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); break;
    case DType::I64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); break;
  }
}

}  // namespace loom
