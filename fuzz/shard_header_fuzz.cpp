// Token shards (train/shard_format.cpp): the 64-byte header and the tokens behind it. The first input
// byte is a control byte, the rest the shard. Control bits: 1 recomputes the token checksum and 2 the
// header checksum before parsing (so the fuzzer reaches the checks behind them), 4 adds an expectation
// (tokenizer hash, vocabulary, split), 8 also writes the bytes to a file and opens it with
// MappedShard::open (the memory-mapped path) and copies every token out.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "fuzz_support.h"
#include "loom/core/checksum.h"
#include "loom/train/shard_format.h"

namespace {
void put_u64(std::vector<unsigned char>& b, size_t off, uint64_t v) { std::memcpy(b.data() + off, &v, 8); }

// The file bit 8 writes: one per process, removed at exit.
struct ScratchFile {
  const std::string path = "/tmp/loom-fuzz-shard-" + std::to_string(::getpid()) + ".bin";
  ~ScratchFile() { std::remove(path.c_str()); }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom::train;
  if (size < 1) return 0;
  const uint8_t control = data[0];
  std::vector<unsigned char> shard(data + 1, data + size);
  if (shard.size() >= kShardHeaderBytes) {
    if (control & 1)
      put_u64(shard, 24, loom::checksum64(shard.data() + kShardHeaderBytes, shard.size() - kShardHeaderBytes));
    if (control & 2) put_u64(shard, 56, loom::checksum64(shard.data(), 56));
  }
  ShardExpectation expect;
  if (control & 4) {
    expect.tokenizer_hash = 0x0123456789abcdefull;
    expect.vocab_size = 512;
    expect.split = Split::Validation;
  }
  const std::string origin = "fuzz/train-00000.bin";
  loom::fuzz::expect_loom_errors(origin, [&] {
    ShardHeader h = check_shard(origin, shard, expect);
    if (kShardHeaderBytes + h.tokens * h.token_bytes != shard.size())
      loom::fuzz::bug("a shard's length was not checked");
  });
  if (control & 8) {
    static const ScratchFile scratch;
    const std::string& file = scratch.path;
    std::ofstream(file, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(shard.data()), static_cast<std::streamsize>(shard.size()));
    loom::fuzz::expect_loom_errors(file, [&] {
      MappedShard s = MappedShard::open(file, expect);
      std::vector<int32_t> tokens(static_cast<size_t>(s.size()));
      s.copy(0, tokens);
      for (int32_t t : tokens)
        if (t < 0 || static_cast<uint32_t>(t) >= s.header().vocab_size)
          loom::fuzz::bug("a token outside the vocabulary");
    });
  }
  return 0;
}
