#include "loom/spec/placement.h"

namespace loom::spec {

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

std::string AxisPlacement::str() const {
  if (kind == Kind::Replicate) return "Replicate";
  if (dim < 0) return "Shard(flat)";
  std::string s = "Shard(" + std::to_string(dim);
  if (blocks > 1) s += ", " + std::to_string(blocks) + " blocks";
  if (pieces > 0) s += ", " + std::to_string(pieces) + " pieces";
  return s + ")";
}

bool Placement::is_replicated() const {
  for (const auto& a : axes)
    if (a.is_shard()) return false;
  return true;
}

std::string Placement::str() const {
  std::string s;
  for (int i = 0; i < kMeshAxes; ++i)
    if (axes[i].is_shard())
      s += (s.empty() ? "" : ",") + std::string(axis_name(static_cast<MeshAxis>(i))) + ":" + axes[i].str();
  return s.empty() ? "Replicate" : s;
}

}  // namespace loom::spec
