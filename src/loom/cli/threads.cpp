#include <omp.h>

#include <cstdlib>
#include <string>

#include "loom/cli/commands.h"
#include "loom/error.h"

namespace loom::cli {

int resolve_threads(int configured) {
  if (const char* env = std::getenv("LOOM_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || v <= 0)
      throw ConfigError("LOOM_THREADS = '" + std::string(env) + "' is not a positive integer");
    return static_cast<int>(v);
  }
  return configured > 0 ? configured : omp_get_num_procs();
}

}  // namespace loom::cli
