#include "loom/comm/store_wire.h"

namespace loom::comm::store_wire {

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
std::string u64_field(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return s;
}
std::optional<uint64_t> field_u64(const std::string& s) {
  if (s.size() != 8) return std::nullopt;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[i])) << (8 * i);
  return v;
}

size_t encoded_size(const Message& m) {
  size_t n = 4 + 1;
  for (const auto& f : m.fields) n += 4 + f.size();
  return n;
}
void encode(const Message& m, std::string& out) {
  put_u32(out, static_cast<uint32_t>(encoded_size(m) - 4));
  out.push_back(static_cast<char>(m.code));
  for (const auto& f : m.fields) {
    put_u32(out, static_cast<uint32_t>(f.size()));
    out += f;
  }
}
std::optional<Message> decode_body(std::string_view body) {
  if (body.empty()) return std::nullopt;
  Message m;
  m.code = static_cast<uint8_t>(body[0]);
  size_t at = 1;
  while (at < body.size()) {
    if (body.size() - at < 4) return std::nullopt;
    uint32_t len = get_u32(body.data() + at);
    at += 4;
    if (body.size() - at < len) return std::nullopt;
    m.fields.emplace_back(body.substr(at, len));
    at += len;
  }
  return m;
}

}  // namespace loom::comm::store_wire
