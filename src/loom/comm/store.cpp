// The rendezvous store: one poll-driven server thread owns the key-value map; clients are plain blocking
// sockets with deadlines.
//
// Wire format, both directions: u32 body length, then the body: u8 code, then fields, each a u32 length
// and its bytes; integers are little-endian. A connection's first request must be kHello with the job
// secret. Waiting requests (get, wait) are parked on the server and answered when a set/add completes
// them or their deadline passes, so a waiting client costs nothing: no polling, no spinning.
#include "loom/comm/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "loom/comm/store_wire.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using namespace store_wire;  // the wire format: Message, encode, decode_body, the codes

// An unauthenticated connection that says nothing is dropped after this long.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Non-waiting requests (set, add, ...) fail when the server does not answer within this.
constexpr auto kRequestTimeout = std::chrono::seconds(60);
// A waiting request is timed by the server; the client allows this much more for the reply to arrive.
constexpr auto kReplyGrace = std::chrono::seconds(2);
// Caps client timeouts so deadline arithmetic cannot overflow (a year is "forever" for a rendezvous).
constexpr milliseconds kMaxWait = std::chrono::hours(24 * 365);
constexpr const char* kWrongSecret =
    "wrong LOOM_JOB_SECRET (a process joins only the job whose launcher gave it the secret)";

class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

std::string errno_text(int e) { return std::strerror(e); }

sockaddr_in resolve_ipv4(const std::string& host, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &sa.sin_addr) == 1) return sa;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr)
    throw CommError(fmt::format("cannot resolve rendezvous host '{}' to an IPv4 address: {}", host, ::gai_strerror(rc)));
  sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return sa;
}

void check_port(int port, bool allow_zero) {
  if (port < (allow_zero ? 0 : 1) || port > 65535)
    throw ConfigError(fmt::format("rendezvous port {} is out of range ({}..65535)", port, allow_zero ? 0 : 1));
}

// Compares in time that depends only on the expected secret's length, so a peer cannot learn the secret
// byte by byte from how fast it is refused.
bool secret_matches(std::string_view given, std::string_view expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>((i < given.size() ? given[i] : 0) ^ expected[i]);
  return diff == 0;
}

int poll_timeout_ms(SteadyClock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - SteadyClock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((left + 999) / 1000, INT_MAX));  // round up: never wake early and spin
}

std::string list_keys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 16;
  std::string s;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > kShown) s += fmt::format(" and {} more", keys.size() - kShown);
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Server

struct StoreServer::Impl {
  struct Waiter {
    bool is_get = false;  // get answers with the value; wait answers with nothing
    std::vector<std::string> keys;
    SteadyClock::time_point deadline;
  };
  struct Conn {
    UniqueFd fd;
    std::string in, out;
    bool authed = false;
    bool closing = false;  // close once `out` is flushed (after a refusal)
    bool dead = false;
    SteadyClock::time_point hello_deadline;
    std::optional<Waiter> waiter;  // a client sends one request at a time, so at most one is parked
  };

  std::string secret;
  UniqueFd listener, wake_read, wake_write;
  int port = 0;
  std::map<std::string, std::string, std::less<>> kv;
  std::vector<std::unique_ptr<Conn>> conns;
  SteadyClock::time_point accept_paused_until{};
  std::thread thread;

  void run();
  void accept_all();
  void read_from(Conn& c);
  void process_input(Conn& c);
  void handle(Conn& c, Message& m);
  void reply(Conn& c, const Message& m);
  void flush(Conn& c);
  void wake_waiters();
  void expire(SteadyClock::time_point now);
  std::vector<std::string> missing(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys)
      if (!kv.contains(k)) out.push_back(k);
    return out;
  }
};

StoreServer::StoreServer(const std::string& bind_addr, int port, std::string secret) : impl_(std::make_unique<Impl>()) {
  check_port(port, true);
  Impl& s = *impl_;
  s.secret = std::move(secret);
  sockaddr_in sa = resolve_ipv4(bind_addr, port);
  s.listener.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (s.listener.get() < 0) throw CommError("cannot create the rendezvous socket: " + errno_text(errno));
  int one = 1;
  ::setsockopt(s.listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // restart on a port in TIME_WAIT
  if (::bind(s.listener.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      ::listen(s.listener.get(), SOMAXCONN) != 0)
    throw CommError(fmt::format("cannot serve the rendezvous on {}:{}: {}", bind_addr, port, errno_text(errno)));
  socklen_t len = sizeof sa;
  ::getsockname(s.listener.get(), reinterpret_cast<sockaddr*>(&sa), &len);
  s.port = ntohs(sa.sin_port);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) throw CommError("cannot create a pipe: " + errno_text(errno));
  s.wake_read.reset(pipe_fds[0]);
  s.wake_write.reset(pipe_fds[1]);
  s.thread = std::thread([&s] { s.run(); });
}

StoreServer::~StoreServer() {
  char b = 1;
  while (::write(impl_->wake_write.get(), &b, 1) < 0 && errno == EINTR) {
  }
  impl_->thread.join();
}

int StoreServer::port() const { return impl_->port; }

void StoreServer::Impl::run() {
  std::vector<pollfd> fds;
  for (;;) {
    auto now = SteadyClock::now();
    SteadyClock::time_point next = SteadyClock::time_point::max();
    fds.clear();
    fds.push_back(pollfd{wake_read.get(), POLLIN, 0});
    fds.push_back(pollfd{listener.get(), 0, 0});
    if (now >= accept_paused_until)
      fds[1].events = POLLIN;
    else
      next = accept_paused_until;
    for (auto& c : conns) {
      fds.push_back(pollfd{c->fd.get(), static_cast<short>(c->out.empty() ? POLLIN : POLLIN | POLLOUT), 0});
      if (c->waiter) next = std::min(next, c->waiter->deadline);
      if (!c->authed) next = std::min(next, c->hello_deadline);
    }
    int timeout = next == SteadyClock::time_point::max() ? -1 : poll_timeout_ms(next);
    if (::poll(fds.data(), fds.size(), timeout) < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(milliseconds(10));  // ENOMEM: retry rather than die
      continue;
    }
    if (fds[0].revents) return;  // the destructor asked us to stop
    const size_t polled = conns.size();
    for (size_t i = 0; i < polled; ++i) {
      Conn& c = *conns[i];
      short ev = fds[i + 2].revents;
      if (ev & (POLLIN | POLLHUP | POLLERR)) read_from(c);
      if ((ev & POLLOUT) && !c.dead) flush(c);
    }
    if (fds[1].revents & POLLIN) accept_all();
    expire(SteadyClock::now());
    std::erase_if(conns, [](const auto& c) { return c->dead; });
  }
}

void StoreServer::Impl::accept_all() {
  for (;;) {
    int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      // Out of descriptors or memory: the listener stays readable, so back off instead of spinning on it.
      if (errno != EAGAIN && errno != EWOULDBLOCK) accept_paused_until = SteadyClock::now() + milliseconds(100);
      return;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto c = std::make_unique<Conn>();
    c->fd.reset(fd);
    c->hello_deadline = SteadyClock::now() + kHelloTimeout;
    conns.push_back(std::move(c));
  }
}

void StoreServer::Impl::read_from(Conn& c) {
  char buf[65536];
  bool peer_closed = false;
  for (;;) {
    ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(buf, static_cast<size_t>(n));
      if (c.in.size() > 4 + static_cast<size_t>(kMaxBody)) break;  // process_input rejects the oversized length
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    peer_closed = true;  // EOF or a reset: apply what already arrived (a set sent just before exit), then drop
    break;
  }
  process_input(c);
  if (peer_closed) c.dead = true;
}

void StoreServer::Impl::process_input(Conn& c) {
  size_t at = 0;
  while (!c.waiter && !c.closing && !c.dead && c.in.size() - at >= 4) {
    uint32_t len = get_u32(c.in.data() + at);
    if (len > (c.authed ? kMaxBody : kMaxHelloBody)) {
      c.dead = true;  // a corrupt stream or not our protocol: nothing sensible to answer
      break;
    }
    if (c.in.size() - at - 4 < len) break;
    auto m = decode_body(std::string_view(c.in).substr(at + 4, len));
    at += 4 + len;
    if (!m) {
      c.dead = true;
      break;
    }
    handle(c, *m);
  }
  c.in.erase(0, at);
}

void StoreServer::Impl::handle(Conn& c, Message& m) {
  auto& f = m.fields;
  if (!c.authed) {
    if (m.code == kHello && f.size() == 1 && secret_matches(f[0], secret)) {
      c.authed = true;
      reply(c, {kOk, {}});
    } else {
      reply(c, {kRefused, {m.code == kHello ? kWrongSecret : "the first request must present LOOM_JOB_SECRET"}});
      c.closing = true;
      flush(c);
    }
    return;
  }
  auto deadline_after = [](const std::string& field) {
    auto ms = std::min<uint64_t>(field_u64(field).value_or(0), kMaxWait.count());
    return SteadyClock::now() + milliseconds(ms);
  };
  bool changed = false;
  if (m.code == kSet && f.size() == 2) {
    kv.insert_or_assign(std::move(f[0]), std::move(f[1]));
    changed = true;
    reply(c, {kOk, {}});
  } else if ((m.code == kGet && f.size() == 2) || (m.code == kTryGet && f.size() == 1)) {
    if (auto it = kv.find(f[0]); it != kv.end())
      reply(c, {kOk, {it->second}});
    else if (m.code == kTryGet)
      reply(c, {kNotFound, {}});
    else
      c.waiter = Waiter{true, {f[0]}, deadline_after(f[1])};
  } else if (m.code == kAdd && f.size() == 2 && f[1].size() == 8) {
    auto& value = kv[f[0]];
    int64_t current = 0;
    if (!value.empty()) {
      char* end = nullptr;
      errno = 0;
      current = std::strtoll(value.c_str(), &end, 10);
      if (errno != 0 || end != value.c_str() + value.size()) {
        reply(c, {kFailed, {fmt::format("add: key '{}' holds '{}', not an integer", f[0], value.substr(0, 40))}});
        return;
      }
    }
    // Two's-complement wrap instead of signed-overflow UB; a counter never gets near it.
    int64_t next = static_cast<int64_t>(static_cast<uint64_t>(current) + *field_u64(f[1]));
    value = std::to_string(next);
    changed = true;
    reply(c, {kOk, {u64_field(static_cast<uint64_t>(next))}});
  } else if (m.code == kWait && !f.empty()) {
    std::vector<std::string> keys(f.begin() + 1, f.end());
    if (missing(keys).empty())
      reply(c, {kOk, {}});
    else
      c.waiter = Waiter{false, std::move(keys), deadline_after(f[0])};
  } else if (m.code == kMissing) {
    reply(c, {kOk, missing(f)});
  } else if (m.code == kErase && f.size() == 1) {
    kv.erase(f[0]);
    reply(c, {kOk, {}});
  } else {
    reply(c, {kFailed, {fmt::format("malformed request (code {}, {} fields)", int{m.code}, f.size())}});
    c.closing = true;
    flush(c);
  }
  if (changed) wake_waiters();
}

void StoreServer::Impl::reply(Conn& c, const Message& m) {
  encode(m, c.out);
  flush(c);
}

void StoreServer::Impl::flush(Conn& c) {
  size_t sent = 0;
  while (sent < c.out.size()) {
    ssize_t n = ::send(c.fd.get(), c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
      break;
    }
  }
  c.out.erase(0, sent);
  if (c.closing && c.out.empty()) c.dead = true;
}

void StoreServer::Impl::wake_waiters() {
  for (auto& cp : conns) {
    Conn& c = *cp;
    if (!c.waiter || c.dead || !missing(c.waiter->keys).empty()) continue;
    Message m{kOk, {}};
    if (c.waiter->is_get) m.fields.push_back(kv.at(c.waiter->keys[0]));
    c.waiter.reset();
    reply(c, m);
    process_input(c);  // a request that arrived behind the parked one (clients do not pipeline, but be exact)
  }
}

void StoreServer::Impl::expire(SteadyClock::time_point now) {
  for (auto& cp : conns) {
    Conn& c = *cp;
    if (!c.authed && now >= c.hello_deadline) c.dead = true;
    if (c.waiter && now >= c.waiter->deadline) {
      Message m{kTimedOut, missing(c.waiter->keys)};
      c.waiter.reset();
      reply(c, m);
      process_input(c);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Client

struct Store::Impl {
  std::string where;  // "addr:port", for every message
  UniqueFd fd;
  bool broken = false;  // after a transport error or a reply that never came, the stream is out of step

  // Sends `req` and returns the reply; `what` names the request in errors.
  Message call(const Message& req, SteadyClock::time_point deadline, const std::string& what);
  void send_all(const std::string& bytes, SteadyClock::time_point deadline, const std::string& what);
  void recv_exact(char* out, size_t n, SteadyClock::time_point deadline, const std::string& what);
  [[noreturn]] void fail(const std::string& what, const std::string& why) {
    broken = true;
    throw CommError(fmt::format("rendezvous at {}: {} failed: {}", where, what, why));
  }
};

void Store::Impl::send_all(const std::string& bytes, SteadyClock::time_point deadline, const std::string& what) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t n = ::send(fd.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) fail(what, errno_text(errno));
    pollfd p{fd.get(), POLLOUT, 0};
    int r = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (r == 0) {
      broken = true;
      throw CommTimeoutError(fmt::format("rendezvous at {}: {}: the server accepted no data in time", where, what));
    }
  }
}

void Store::Impl::recv_exact(char* out, size_t n, SteadyClock::time_point deadline, const std::string& what) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd.get(), out + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) fail(what, "the server closed the connection (did the launcher or rank 0 exit?)");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) fail(what, errno_text(errno));
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, poll_timeout_ms(deadline)) == 0) {
      broken = true;
      throw CommTimeoutError(fmt::format("rendezvous at {}: {}: no answer from the server in time", where, what));
    }
  }
}

Message Store::Impl::call(const Message& req, SteadyClock::time_point deadline, const std::string& what) {
  if (broken) throw CommError(fmt::format("rendezvous at {}: {}: the connection broke on an earlier request", where, what));
  if (encoded_size(req) - 4 > kMaxBody)
    throw CommError(fmt::format("rendezvous at {}: {}: request of {} bytes exceeds the store's {} MiB limit", where, what,
                                encoded_size(req), kMaxBody >> 20));
  std::string bytes;
  encode(req, bytes);
  send_all(bytes, deadline, what);
  char header[4];
  recv_exact(header, 4, deadline, what);
  uint32_t len = get_u32(header);
  if (len == 0 || len > kMaxBody) fail(what, fmt::format("malformed reply (length {})", len));
  std::string body(len, '\0');
  recv_exact(body.data(), len, deadline, what);
  auto m = decode_body(body);
  if (!m) fail(what, "malformed reply");
  if (m->code == kFailed) throw CommError(fmt::format("rendezvous at {}: {}: {}", where, what, m->fields.empty() ? "" : m->fields[0]));
  return std::move(*m);
}

Store::Store(const std::string& addr, int port, const std::string& secret, milliseconds connect_timeout)
    : impl_(std::make_unique<Impl>()) {
  check_port(port, false);
  Impl& s = *impl_;
  s.where = fmt::format("{}:{}", addr, port);
  const sockaddr_in sa = resolve_ipv4(addr, port);
  const auto deadline = SteadyClock::now() + std::clamp(connect_timeout, milliseconds(0), kMaxWait);
  int backoff_ms = 5;
  for (;;) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) throw CommError("cannot create a socket: " + errno_text(errno));
    int err = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      if (::poll(&p, 1, poll_timeout_ms(deadline)) == 1) {
        socklen_t len = sizeof err;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      } else {
        err = ETIMEDOUT;
      }
    }
    if (err == 0) {
      // Retrying connect() to a loopback port nobody listens on can "succeed" as a TCP simultaneous open
      // with itself (source port == destination port); that is not the server.
      sockaddr_in local{};
      socklen_t len = sizeof local;
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len);
      if (local.sin_port == sa.sin_port && local.sin_addr.s_addr == sa.sin_addr.s_addr)
        err = ECONNREFUSED;
    }
    if (err == 0) {
      s.fd = std::move(fd);
      break;
    }
    auto left = std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now());
    if (left.count() <= 0)
      throw CommError(fmt::format(
          "cannot reach the rendezvous at {} within {} ms: {} (is the launcher or rank 0 running, and are "
          "LOOM_MASTER_ADDR / LOOM_MASTER_PORT right?)",
          s.where, connect_timeout.count(), errno_text(err)));
    std::this_thread::sleep_for(std::min(left, milliseconds(backoff_ms)));
    backoff_ms = std::min(backoff_ms * 2, 100);
  }
  int one = 1;
  ::setsockopt(s.fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // requests are tiny and latency-bound
  auto reply = s.call({kHello, {secret}}, std::max(deadline, SteadyClock::now() + kHelloTimeout), "joining");
  if (reply.code == kRefused)
    throw CommError(fmt::format("rendezvous at {} refused this process: {}", s.where,
                                reply.fields.empty() ? kWrongSecret : reply.fields[0]));
  if (reply.code != kOk) s.fail("joining", "unexpected reply");
}

Store::~Store() = default;

void Store::set(const std::string& key, std::string_view value) {
  impl_->call({kSet, {key, std::string(value)}}, SteadyClock::now() + kRequestTimeout, fmt::format("set('{}')", key));
}

std::string Store::get(const std::string& key, milliseconds timeout) {
  timeout = std::clamp(timeout, milliseconds(0), kMaxWait);
  auto m = impl_->call({kGet, {key, u64_field(static_cast<uint64_t>(timeout.count()))}},
                       SteadyClock::now() + timeout + kReplyGrace, fmt::format("get('{}')", key));
  if (m.code == kTimedOut)
    throw CommTimeoutError(
        fmt::format("rendezvous at {}: key '{}' did not appear within {} ms", impl_->where, key, timeout.count()));
  if (m.code != kOk || m.fields.size() != 1) impl_->fail(fmt::format("get('{}')", key), "unexpected reply");
  return std::move(m.fields[0]);
}

std::optional<std::string> Store::try_get(const std::string& key) {
  auto m = impl_->call({kTryGet, {key}}, SteadyClock::now() + kRequestTimeout, fmt::format("try_get('{}')", key));
  if (m.code == kNotFound) return std::nullopt;
  if (m.code != kOk || m.fields.size() != 1) impl_->fail(fmt::format("try_get('{}')", key), "unexpected reply");
  return std::move(m.fields[0]);
}

int64_t Store::add(const std::string& key, int64_t delta) {
  auto m = impl_->call({kAdd, {key, u64_field(static_cast<uint64_t>(delta))}}, SteadyClock::now() + kRequestTimeout,
                       fmt::format("add('{}')", key));
  auto v = m.fields.size() == 1 ? field_u64(m.fields[0]) : std::nullopt;
  if (m.code != kOk || !v) impl_->fail(fmt::format("add('{}')", key), "unexpected reply");
  return static_cast<int64_t>(*v);
}

void Store::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  timeout = std::clamp(timeout, milliseconds(0), kMaxWait);
  Message req{kWait, {u64_field(static_cast<uint64_t>(timeout.count()))}};
  req.fields.insert(req.fields.end(), keys.begin(), keys.end());
  auto m = impl_->call(req, SteadyClock::now() + timeout + kReplyGrace, fmt::format("wait({} keys)", keys.size()));
  if (m.code == kTimedOut)
    throw CommTimeoutError(fmt::format("rendezvous at {}: {} of {} keys still missing after {} ms: {}", impl_->where,
                                       m.fields.size(), keys.size(), timeout.count(), list_keys(m.fields)));
  if (m.code != kOk) impl_->fail("wait", "unexpected reply");
}

std::vector<std::string> Store::missing(const std::vector<std::string>& keys) {
  auto m = impl_->call({kMissing, keys}, SteadyClock::now() + kRequestTimeout, "missing");
  if (m.code != kOk) impl_->fail("missing", "unexpected reply");
  return std::move(m.fields);
}

void Store::erase(const std::string& key) {
  impl_->call({kErase, {key}}, SteadyClock::now() + kRequestTimeout, fmt::format("erase('{}')", key));
}

std::string make_job_secret() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (errno != EINTR) {
      // Kernels before 3.17 lack getrandom: the same pool through the device file.
      UniqueFd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
      while (fd.get() >= 0 && got < sizeof bytes) {
        ssize_t r = ::read(fd.get(), bytes + got, sizeof bytes - got);
        if (r <= 0 && errno != EINTR) break;
        if (r > 0) got += static_cast<size_t>(r);
      }
      if (got < sizeof bytes) throw CommError("cannot read random bytes for the job secret: " + errno_text(errno));
    }
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char b : bytes) {
    hex.push_back(kHex[b >> 4]);
    hex.push_back(kHex[b & 15]);
  }
  return hex;
}

}  // namespace loom::comm
