// The rendezvous store's wire format (comm/store.cpp), shared by the server, the client and the fuzz
// target: u32 body length, then the body: u8 code, then fields, each a u32 length and its bytes;
// integers are little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::comm::store_wire {

enum Code : uint8_t {
  kHello = 1, kSet, kGet, kTryGet, kAdd, kWait, kMissing, kErase,     // requests
  kOk = 100, kNotFound, kTimedOut, kRefused, kFailed,                  // replies
};

// Rendezvous values are addresses and names; the cap only stops a corrupt or hostile length from making
// the server allocate gigabytes. Before the secret is checked a peer may send barely more than a secret.
constexpr uint32_t kMaxBody = (64u << 20) + 4096;
constexpr uint32_t kMaxHelloBody = 4096;

struct Message {
  uint8_t code = 0;
  std::vector<std::string> fields;
};

void put_u32(std::string& out, uint32_t v);
uint32_t get_u32(const char* p);
std::string u64_field(uint64_t v);
std::optional<uint64_t> field_u64(const std::string& s);

// Bytes encode() appends: the 4-byte length prefix included.
size_t encoded_size(const Message& m);
// Appends the frame (length prefix and body) of `m` to `out`.
void encode(const Message& m, std::string& out);
// The message in a body (the bytes after the length prefix); nullopt when a field overruns it.
std::optional<Message> decode_body(std::string_view body);

}  // namespace loom::comm::store_wire
