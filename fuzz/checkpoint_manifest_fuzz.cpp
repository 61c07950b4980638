// A checkpoint's manifest.json (train/checkpoint_manifest.cpp), as resume, generate and export read it.
// The input is the file's text.
#include "fuzz_support.h"
#include "loom/train/checkpoint_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string origin = "fuzz/step-00000001/manifest.json";
  loom::fuzz::expect_loom_errors(origin, [&] {
    auto m = loom::train::parse_checkpoint_manifest(loom::fuzz::text(data, size), origin);
    if (m.step < 0 || m.optimizer_steps < 0) loom::fuzz::bug("a negative step was accepted");
    if (m.tokenizer && (m.tokenizer->file.empty() || m.tokenizer->file.find('/') != std::string::npos))
      loom::fuzz::bug("a tokenizer file outside the checkpoint folder was accepted: " + m.tokenizer->file);
  });
  return 0;
}
