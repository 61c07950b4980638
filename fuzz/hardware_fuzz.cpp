// The planner's hardware files (plan/hardware.cpp). The input is the TOML text. A description that
// parses must also survive hardware_to_toml (what `loom calibrate` writes) and parse again.
#include "fuzz_support.h"
#include "loom/plan/hardware.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string origin = "fuzz/hardware/h100.toml";
  loom::fuzz::expect_loom_errors(origin, [&] {
    auto hw = loom::plan::parse_hardware(loom::fuzz::text(data, size), origin);
    const std::string toml = loom::plan::hardware_to_toml(hw, "fuzz", {{"device", "a note"}});
    loom::plan::Hardware again;
    try {
      again = loom::plan::parse_hardware(toml, "hardware_to_toml()");
    } catch (const std::exception& e) {
      loom::fuzz::bug(std::string("hardware_to_toml() does not parse again: ") + e.what() + "\n" + toml);
    }
    if (again.name != hw.name || again.source != hw.source || again.device.name != hw.device.name ||
        again.devices_per_node != hw.devices_per_node || again.intra_node.topology != hw.intra_node.topology)
      loom::fuzz::bug("hardware_to_toml() does not round-trip:\n" + toml);
  });
  return 0;
}
