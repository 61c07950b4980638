#include "loom/spec/placement.h"

namespace loom::spec {

namespace {
const char* axis_name(MeshAxis a) {
  switch (a) {
    case MeshAxis::PP: return "pp";
    case MeshAxis::DP: return "dp";
    case MeshAxis::CP: return "cp";
    case MeshAxis::TP: return "tp";
    case MeshAxis::EP: return "ep";
  }
  return "?";
}
}  // namespace

std::string Placement::str() const {
  if (kind == Kind::Replicate) return "Replicate";
  return "Shard(" + std::to_string(dim) + ")@" + axis_name(axis);
}

}  // namespace loom::spec
