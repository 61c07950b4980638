// One token shard on disk: a 64-byte little-endian header (magic, version,
// token width, count, checksums, the tokenizer's hash and vocabulary, the
// split) followed by the tokens. Byte layout in docs/data.md. The reader
// memory-maps the file and refuses anything that is not exactly that.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>

#include "loom/train/token_source.h"

namespace loom::train {

inline constexpr char kShardMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

struct ShardHeader {
  uint32_t version = kShardVersion;
  uint32_t token_bytes = 2;  // 2: u16 tokens (vocab <= 65536), 4: u32
  uint64_t tokens = 0;
  uint64_t checksum = 0;  // checksum64 (core/checksum.h) of the token bytes
  uint64_t tokenizer_hash = 0;
  uint32_t vocab_size = 0;
  Split split = Split::Train;
  uint64_t documents = 0;
};

// The narrowest width that holds every id below `vocab_size`.
uint32_t token_bytes_for(int64_t vocab_size);

// Writes a shard durably (temporary file, fsync, rename). `header.tokens` and
// `header.checksum` are filled from `tokens`. Throws ConfigError when a token
// is outside [0, vocab), IoError on I/O.
ShardHeader write_shard(const std::filesystem::path& path, ShardHeader header, std::span<const int32_t> tokens);

// What the reader must find in the header; unset fields are not checked.
struct ShardExpectation {
  std::optional<uint64_t> tokenizer_hash;
  std::optional<uint32_t> vocab_size;
  std::optional<Split> split;
};

// Validates a whole shard's bytes (header and tokens) as MappedShard::open does and returns its
// header; `path` names the shard in errors. Throws IoError naming the file, the problem and the fix.
ShardHeader check_shard(const std::filesystem::path& path, std::span<const unsigned char> bytes,
                        const ShardExpectation& expect = {});

// A read-only, memory-mapped, validated shard. Move-only; unmaps on
// destruction.
class MappedShard {
 public:
  // Validates size, magic, version, width, header checksum, length,
  // expectations, token checksum and every token < vocab (one pass over the
  // file). Throws IoError naming the file, the problem and the fix.
  static MappedShard open(const std::filesystem::path& path, const ShardExpectation& expect = {});

  MappedShard(MappedShard&& o) noexcept;
  MappedShard& operator=(MappedShard&& o) noexcept;
  MappedShard(const MappedShard&) = delete;
  MappedShard& operator=(const MappedShard&) = delete;
  ~MappedShard();

  const ShardHeader& header() const { return header_; }
  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return static_cast<int64_t>(header_.tokens); }
  int32_t at(int64_t i) const;
  // Copies tokens [first, first + out.size()) as int32.
  void copy(int64_t first, std::span<int32_t> out) const;

 private:
  MappedShard() = default;
  std::filesystem::path path_;
  ShardHeader header_;
  const unsigned char* base_ = nullptr;  // the whole mapping; tokens start at kShardHeaderBytes
  size_t mapped_bytes_ = 0;
};

}  // namespace loom::train
