// The rendezvous store's message bodies (comm/store_wire.cpp), as the server and the client decode
// them. The input is one body (the bytes after the u32 length). A body that decodes must encode back to
// the same bytes.
#include "fuzz_support.h"
#include "loom/comm/store_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom::comm::store_wire;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  auto m = decode_body(body);
  if (!m) return 0;
  std::string frame;
  encode(*m, frame);
  if (frame.size() != encoded_size(*m) || frame.size() != 4 + size || get_u32(frame.data()) != size ||
      std::string_view(frame).substr(4) != body)
    loom::fuzz::bug("a decoded body does not encode back to the same bytes");
  for (const auto& f : m->fields)
    if (auto v = field_u64(f); v && u64_field(*v) != f) loom::fuzz::bug("u64 fields do not round-trip");
  return 0;
}
