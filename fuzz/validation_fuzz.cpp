// The planner's validation file (plan/validation.cpp, tests/plan/published_results.toml): its rows,
// resolved against the models the planner knows and configs/hardware/. The input is the TOML text.
// Only the parsing is fuzzed: evaluating a row runs the planner's search (tens of milliseconds).
#include "fuzz_support.h"
#include "loom/plan/validation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string origin = "fuzz/published_results.toml";
  loom::fuzz::expect_loom_errors(origin, [&] {
    auto rows =
        loom::plan::parse_validation(loom::fuzz::text(data, size), origin, {LOOM_SOURCE_DIR "/configs/hardware"});
    for (const auto& r : rows)
      if (r.devices < 1 || r.tp < 1 || r.pp < 1 || r.devices % (r.tp * r.pp) != 0)
        loom::fuzz::bug("row '" + r.name + "' has degrees that do not fit its devices");
  });
  return 0;
}
