// safetensors files (core/safetensors.cpp): the header length, the JSON header, every tensor's offsets.
// The input is a whole file.
#include <vector>

#include "fuzz_support.h"
#include "loom/core/checksum.h"
#include "loom/core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string origin = "fuzz/model.safetensors";
  loom::fuzz::expect_loom_errors(origin, [&] {
    loom::SafetensorsFile f(std::vector<char>(data, data + size), origin);
    // Read every byte a tensor claims: an offset that slipped past the checks is an ASan report here.
    volatile uint64_t sink = 0;
    for (const auto& e : f.tensors()) {
      sink = sink + loom::checksum64(e.data, e.nbytes);
      if (f.at(e.name).data != e.data || !f.contains(e.name)) loom::fuzz::bug("a listed tensor cannot be found");
    }
  });
  return 0;
}
