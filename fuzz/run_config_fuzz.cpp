// Run configurations (train/run_config.cpp): the TOML text and `--set key=value` overrides. The input
// is the TOML text, then NUL-separated overrides. A configuration that parses must also survive the
// round trip a checkpoint makes: to_toml() parses again to the same configuration.
#include "fuzz_support.h"
#include "loom/train/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto parts =
      loom::fuzz::split(std::string_view(reinterpret_cast<const char*>(data), size), std::string_view("\0", 1));
  const std::string text = parts[0];
  const std::vector<std::string> overrides(parts.begin() + 1, parts.end());
  // Messages about a key's value name the key rather than the file, so the origin is not required.
  loom::fuzz::expect_loom_errors("", [&] {
    auto c = loom::train::parse_run_config(text, "fuzz/config.toml", overrides);
    const std::string toml = c.to_toml();
    std::string again;
    try {
      again = loom::train::parse_run_config(toml, "to_toml()").to_toml();
    } catch (const std::exception& e) {
      loom::fuzz::bug(std::string("to_toml() does not parse again: ") + e.what() + "\n" + toml);
    }
    if (again != toml) loom::fuzz::bug("to_toml() does not round-trip:\n" + toml + "\n---\n" + again);
  });
  return 0;
}
