// The rendezvous store's server (comm/store.cpp) handling what clients send: framing, the secret
// check, every request kind, parked get/wait requests woken by another connection or expiring. A fresh
// server per input (port 0 on 127.0.0.1), so no state leaks between inputs.
//
// Input: a control byte, then the bytes of up to three connections separated by "CONN". Control bit 1
// prepends a correct hello (the secret) to every connection. Connection 0 sends its bytes and stays open
// while the others, one after another, send theirs, half-close and read until the server closes; then
// connection 0 half-closes and reads to the end. Every reply must be a well-formed frame with a reply
// code; the server must close each half-closed connection within 5 s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "fuzz_support.h"
#include "loom/comm/store.h"
#include "loom/comm/store_wire.h"

namespace {

using namespace loom::comm::store_wire;
const std::string kSecret = "fuzz-secret";

class Client {
 public:
  explicit Client(int port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    if (fd_ < 0) loom::fuzz::bug("socket() failed");
    // The client closes first, so each connection leaves a TIME_WAIT entry behind for a minute (tens of
    // thousands from 127.0.0.1 within a minute); each connection comes from another address of 127/8,
    // so a long run never competes for ephemeral ports.
    static uint32_t next_source = 0;
    sockaddr_in src{};
    src.sin_family = AF_INET;
    src.sin_addr.s_addr = htonl((127u << 24) | (1 + next_source++ % 0xfffffe));
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0)
      loom::fuzz::bug(std::string("cannot bind a loopback source address: ") + std::strerror(errno));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      // libFuzzer's SIGALRM (its -timeout watchdog) interrupts a blocking connect, which then goes on
      // in the background: wait for it.
      int err = errno;
      if (err == EINTR) {
        pollfd p{fd_, POLLOUT, 0};
        while (::poll(&p, 1, 5000) < 0 && errno == EINTR) {
        }
        socklen_t len = sizeof err;
        ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
      }
      if (err != 0) loom::fuzz::bug(std::string("cannot connect to the store: ") + std::strerror(err));
    }
  }
  ~Client() { ::close(fd_); }
  void send_all(const std::string& bytes) {
    for (size_t sent = 0; sent < bytes.size();) {
      ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // the server closed a connection it refused: fine
      sent += static_cast<size_t>(n);
    }
  }
  // Half-closes, reads until the server closes, and checks every complete reply frame.
  void finish() {
    ::shutdown(fd_, SHUT_WR);
    std::string in;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      const int ready = left.count() <= 0 ? 0 : ::poll(&p, 1, static_cast<int>(left.count()));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) loom::fuzz::bug("the store server did not close a half-closed connection within 5 s");
      char buf[65536];
      ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) break;  // EOF, or a reset after the server dropped a bad stream
      in.append(buf, static_cast<size_t>(n));
    }
    // A connection dropped mid-reply may end in a partial frame; every whole one must decode.
    for (size_t at = 0; in.size() - at >= 4;) {
      uint32_t len = get_u32(in.data() + at);
      if (in.size() - at - 4 < len) break;
      auto m = decode_body(std::string_view(in).substr(at + 4, len));
      if (!m || m->code < kOk || m->code > kFailed) loom::fuzz::bug("the server sent a malformed reply");
      at += 4 + len;
    }
  }

 private:
  int fd_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool hello = data[0] & 1;
  auto conns = loom::fuzz::split(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1), "CONN");
  if (conns.size() > 3) conns.resize(3);
  std::string hello_frame;
  if (hello) encode(Message{kHello, {kSecret}}, hello_frame);
  loom::comm::StoreServer server("127.0.0.1", 0, kSecret);
  Client first(server.port());
  first.send_all(hello_frame + conns[0]);
  for (size_t i = 1; i < conns.size(); ++i) {
    Client c(server.port());
    c.send_all(hello_frame + conns[i]);
    c.finish();
  }
  first.finish();
  return 0;
}
