// Rendezvous key-value store over TCP: how ranks find each other before any transport exists.
// One server per job (the launcher, or rank 0 under mpirun); every client must present the job secret.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::comm {

// Serves the store on a background thread until destroyed. Binds `bind_addr` ("127.0.0.1" unless a
// multi-node job says otherwise); port 0 picks a free port (see port()). A connection that does not
// open with the right secret is answered with an error and closed: it can neither read nor write.
class StoreServer {
 public:
  StoreServer(const std::string& bind_addr, int port, std::string secret);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A client connection. Thread-compatible (one thread at a time). Every blocking call takes a deadline;
// on expiry it throws CommTimeoutError naming the key(s) still missing. A refused secret throws
// CommError ("... refused this process: wrong LOOM_JOB_SECRET ..."). Connecting retries until
// `connect_timeout` so ranks may start before the server.
class Store {
 public:
  Store(const std::string& addr, int port, const std::string& secret, std::chrono::milliseconds connect_timeout);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void set(const std::string& key, std::string_view value);
  // Waits until the key exists.
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  std::optional<std::string> try_get(const std::string& key);
  // Atomically adds `delta` to an integer key (missing = 0) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // Waits until every key exists; on timeout the error lists the missing keys.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Which of `keys` do not exist now (no waiting).
  std::vector<std::string> missing(const std::vector<std::string>& keys);
  void erase(const std::string& key);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// 32 random bytes from the OS, hex-encoded: a per-job secret.
std::string make_job_secret();

}  // namespace loom::comm
