#include "loom/train/shard_format.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include "loom/core/checksum.h"
#include "loom/core/file_writer.h"
#include "loom/error.h"
#include "loom/train/shard_set.h"

namespace loom::train {

// Tokens are stored little-endian and read by memcpy; a big-endian port would
// byte-swap here.
static_assert(std::endian::native == std::endian::little, "shard I/O assumes a little-endian host");

namespace fs = std::filesystem;

namespace {

// Header field offsets (docs/data.md is the reference; keep both in step).
constexpr size_t kOffVersion = 8, kOffTokenBytes = 12, kOffTokens = 16, kOffChecksum = 24, kOffTokenizer = 32,
                 kOffVocab = 40, kOffSplit = 44, kOffDocuments = 48, kOffHeaderChecksum = 56;

template <typename T>
void put(unsigned char* h, size_t off, T v) {
  std::memcpy(h + off, &v, sizeof(T));
}
template <typename T>
T get(const unsigned char* h, size_t off) {
  T v;
  std::memcpy(&v, h + off, sizeof(T));
  return v;
}

std::string hex(uint64_t v) { return checksum_hex(v); }

[[noreturn]] void refuse(const fs::path& p, const std::string& problem, const std::string& fix) {
  throw IoError("shard '" + p.string() + "' " + problem + ": " + fix);
}

const std::string kRedo = "re-run `loom prepare` to rebuild the shards";

// Largest token id and checksum in one pass over the mapped token bytes.
template <typename T>
uint32_t max_token(const unsigned char* p, uint64_t n) {
  T m = 0;
  for (uint64_t i = 0; i < n; ++i) m = std::max(m, get<T>(p, i * sizeof(T)));
  return m;
}

}  // namespace

uint32_t token_bytes_for(int64_t vocab_size) { return vocab_size <= 65536 ? 2u : 4u; }

ShardHeader write_shard(const fs::path& path, ShardHeader h, std::span<const int32_t> tokens) {
  if (h.token_bytes != 2 && h.token_bytes != 4) throw ConfigError("shard token width must be 2 or 4 bytes");
  if (h.vocab_size == 0 || h.vocab_size > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
    throw ConfigError("vocabulary " + std::to_string(h.vocab_size) + " is not a valid shard vocabulary (1 to 2^31-1)");
  if (h.token_bytes == 2 && h.vocab_size > 65536)
    throw ConfigError("vocabulary " + std::to_string(h.vocab_size) + " does not fit u16 shard tokens");
  std::vector<unsigned char> data(tokens.size() * h.token_bytes);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || static_cast<uint32_t>(t) >= h.vocab_size)
      throw ConfigError("token " + std::to_string(t) + " at position " + std::to_string(i) + " of shard '" +
                        path.string() + "' is outside the vocabulary [0, " + std::to_string(h.vocab_size) + ")");
    if (h.token_bytes == 2)
      put(data.data(), i * 2, static_cast<uint16_t>(t));
    else
      put(data.data(), i * 4, static_cast<uint32_t>(t));
  }
  h.version = kShardVersion;
  h.tokens = tokens.size();
  h.checksum = checksum64(data.data(), data.size());

  unsigned char hdr[kShardHeaderBytes] = {};
  std::memcpy(hdr, kShardMagic, sizeof(kShardMagic));
  put(hdr, kOffVersion, h.version);
  put(hdr, kOffTokenBytes, h.token_bytes);
  put(hdr, kOffTokens, h.tokens);
  put(hdr, kOffChecksum, h.checksum);
  put(hdr, kOffTokenizer, h.tokenizer_hash);
  put(hdr, kOffVocab, h.vocab_size);
  put(hdr, kOffSplit, static_cast<uint32_t>(h.split == Split::Train ? 0 : 1));
  put(hdr, kOffDocuments, h.documents);
  put(hdr, kOffHeaderChecksum, checksum64(hdr, kOffHeaderChecksum));

  // Temporary name + rename: a reader never maps a half-written shard under the
  // final name.
  const fs::path tmp = path.string() + ".tmp";
  {
    FileWriter w(tmp.string());
    w.write(hdr, sizeof(hdr));
    w.write(data.data(), data.size());
    w.sync();
    w.close();
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw IoError("cannot rename '" + tmp.string() + "' to '" + path.string() + "': " + ec.message());
  return h;
}

MappedShard::MappedShard(MappedShard&& o) noexcept
    : path_(std::move(o.path_)), header_(o.header_), base_(o.base_), mapped_bytes_(o.mapped_bytes_) {
  o.base_ = nullptr;
  o.mapped_bytes_ = 0;
}

MappedShard& MappedShard::operator=(MappedShard&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(const_cast<unsigned char*>(base_), mapped_bytes_);
    path_ = std::move(o.path_);
    header_ = o.header_;
    base_ = o.base_;
    mapped_bytes_ = o.mapped_bytes_;
    o.base_ = nullptr;
    o.mapped_bytes_ = 0;
  }
  return *this;
}

MappedShard::~MappedShard() {
  if (base_) ::munmap(const_cast<unsigned char*>(base_), mapped_bytes_);
}

ShardHeader check_shard(const fs::path& path, std::span<const unsigned char> bytes, const ShardExpectation& expect) {
  const unsigned char* b = bytes.data();
  const uint64_t size = bytes.size();
  if (size < kShardHeaderBytes)
    refuse(path,
           "is truncated: " + std::to_string(size) + " bytes, shorter than the " + std::to_string(kShardHeaderBytes) +
               "-byte header",
           kRedo);
  if (std::memcmp(b, kShardMagic, sizeof(kShardMagic)) != 0)
    refuse(path, "is not a Loom token shard (its first 8 bytes are not \"LOOMTOKS\")",
           "point data.dir at a folder written by `loom prepare`");
  ShardHeader h;
  h.version = get<uint32_t>(b, kOffVersion);
  if (h.version != kShardVersion)
    refuse(path,
           "has format version " + std::to_string(h.version) + " but this build reads version " +
               std::to_string(kShardVersion),
           "re-run `loom prepare` with this build");
  if (get<uint64_t>(b, kOffHeaderChecksum) != checksum64(b, kOffHeaderChecksum))
    refuse(path, "has a corrupted header (header checksum mismatch)", kRedo);
  h.token_bytes = get<uint32_t>(b, kOffTokenBytes);
  h.tokens = get<uint64_t>(b, kOffTokens);
  h.checksum = get<uint64_t>(b, kOffChecksum);
  h.tokenizer_hash = get<uint64_t>(b, kOffTokenizer);
  h.vocab_size = get<uint32_t>(b, kOffVocab);
  const uint32_t split = get<uint32_t>(b, kOffSplit);
  h.documents = get<uint64_t>(b, kOffDocuments);
  if ((h.token_bytes != 2 && h.token_bytes != 4) || split > 1)
    refuse(path,
           "has an invalid header (token width " + std::to_string(h.token_bytes) + ", split " + std::to_string(split) +
               ")",
           kRedo);
  h.split = split == 0 ? Split::Train : Split::Validation;
  // Token ids are int32 everywhere after the loader: a vocabulary past that range would let a token
  // within it turn negative on the way in.
  if (h.vocab_size == 0 || h.vocab_size > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
    refuse(path, "has an invalid header (vocabulary of " + std::to_string(h.vocab_size) + " tokens)", kRedo);
  if (h.tokens == 0) refuse(path, "holds no tokens", kRedo);
  const uint64_t data_bytes = size - kShardHeaderBytes;
  // Compare by division first: a corrupted count must not overflow the
  // multiplication.
  if (h.tokens > data_bytes / h.token_bytes)
    refuse(path,
           "is truncated: the header promises " + std::to_string(h.tokens) + " tokens of " +
               std::to_string(h.token_bytes) + " bytes but the file holds " + std::to_string(data_bytes) +
               " bytes after the header",
           kRedo);
  if (data_bytes != h.tokens * h.token_bytes)
    refuse(path,
           "has " + std::to_string(data_bytes - h.tokens * h.token_bytes) + " unexpected bytes after its " +
               std::to_string(h.tokens) + " tokens",
           kRedo);
  if (expect.tokenizer_hash && *expect.tokenizer_hash != h.tokenizer_hash)
    refuse(path,
           "was made with tokenizer " + hex(h.tokenizer_hash) + " but the tokenizer in use is " +
               hex(*expect.tokenizer_hash),
           "re-run `loom prepare` with this tokenizer (--tokenizer FILE), or use the tokenizer.model the shards came "
           "with");
  if (expect.vocab_size && *expect.vocab_size != h.vocab_size)
    refuse(path,
           "was made for a vocabulary of " + std::to_string(h.vocab_size) + " tokens but the tokenizer has " +
               std::to_string(*expect.vocab_size),
           kRedo);
  if (expect.split && *expect.split != h.split)
    refuse(path, std::string("holds ") + split_name(h.split) + " tokens but is listed as " + split_name(*expect.split),
           kRedo);
  const unsigned char* data = b + kShardHeaderBytes;
  const uint64_t sum = checksum64(data, data_bytes);
  if (sum != h.checksum)
    refuse(path, "is corrupted: its tokens' checksum is " + hex(sum) + " but the header says " + hex(h.checksum),
           kRedo);
  const uint32_t top = h.token_bytes == 2 ? max_token<uint16_t>(data, h.tokens) : max_token<uint32_t>(data, h.tokens);
  if (top >= h.vocab_size)
    refuse(path, "holds token " + std::to_string(top) + ", outside its vocabulary of " + std::to_string(h.vocab_size),
           kRedo);
  return h;
}

MappedShard MappedShard::open(const fs::path& path, const ShardExpectation& expect) {
  MappedShard s;
  s.path_ = path;
  {
    // The descriptor is only needed until the mapping exists.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) refuse(path, std::string("cannot be opened (") + std::strerror(errno) + ")", kRedo);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      refuse(path, std::string("cannot be examined (") + std::strerror(e) + ")", kRedo);
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size == 0) {
      ::close(fd);
      refuse(path, "is empty (0 bytes)", kRedo);
    }
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) refuse(path, std::string("cannot be memory-mapped (") + std::strerror(e) + ")", kRedo);
    s.base_ = static_cast<const unsigned char*>(p);
    s.mapped_bytes_ = size;
  }
  s.header_ = check_shard(path, {s.base_, s.mapped_bytes_}, expect);
  return s;
}

int32_t MappedShard::at(int64_t i) const {
  const unsigned char* data = base_ + kShardHeaderBytes;
  return header_.token_bytes == 2 ? static_cast<int32_t>(get<uint16_t>(data, static_cast<size_t>(i) * 2))
                                  : static_cast<int32_t>(get<uint32_t>(data, static_cast<size_t>(i) * 4));
}

void MappedShard::copy(int64_t first, std::span<int32_t> out) const {
  if (first < 0 || first + static_cast<int64_t>(out.size()) > size())
    throw ShapeError("shard '" + path_.string() + "': tokens [" + std::to_string(first) + ", " +
                     std::to_string(first + static_cast<int64_t>(out.size())) + ") are outside [0, " +
                     std::to_string(size()) + ")");
  const unsigned char* data = base_ + kShardHeaderBytes;
  if (header_.token_bytes == 2) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = get<uint16_t>(data, (static_cast<size_t>(first) + i) * 2);
  } else {
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<int32_t>(get<uint32_t>(data, (static_cast<size_t>(first) + i) * 4));
  }
}

}  // namespace loom::train
