#include "loom/spec/recompute.h"

#include "loom/error.h"

namespace loom::spec {

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

Recompute parse_recompute(std::string_view name, std::string_view key) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    if (name == recompute_name(r)) return r;
  throw ConfigError(std::string(key) + " = \"" + std::string(name) +
                    "\" is not a recompute policy (\"none\", \"selective\" or \"full\")");
}

}  // namespace loom::spec
