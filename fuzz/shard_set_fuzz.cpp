// A prepared corpus's manifest.json (train/shard_set.cpp), as the shard loader reads it. The input is
// the file's text.
#include "fuzz_support.h"
#include "loom/train/shard_set.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string origin = "fuzz/data/manifest.json";
  loom::fuzz::expect_loom_errors(origin, [&] {
    auto s = loom::train::parse_shard_set(loom::fuzz::text(data, size), origin);
    for (const auto& e : s.shards)
      if (e.file.empty() || e.file.find('/') != std::string::npos)
        loom::fuzz::bug("a shard outside the folder: " + e.file);
  });
  return 0;
}
