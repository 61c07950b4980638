#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "loom/cli/commands.h"
#include "loom/error.h"

namespace loom::cli {

int resolve_threads(int configured, int ranks_on_node) {
  if (const char* env = std::getenv("LOOM_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || v <= 0)
      throw ConfigError("LOOM_THREADS = '" + std::string(env) + "' is not a positive integer");
    return static_cast<int>(v);
  }
  if (configured > 0) return configured;
  // Ranks sharing a node share its cores (`loom run` says so with LOOM_THREADS; mpirun does not):
  // every rank taking every core would oversubscribe them and spin-waiting threads would thrash.
  return std::max(1, omp_get_num_procs() / std::max(1, ranks_on_node));
}

}  // namespace loom::cli
