// The rendezvous store: a TCP key-value server guarded by the job secret.
#include "loom/comm/store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "loom/error.h"

namespace loom::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

const std::string kSecret = "0123456789abcdef0123456789abcdef";

TEST(Store, SetGetAddAndEraseAcrossClients) {
  StoreServer server("127.0.0.1", 0, kSecret);
  ASSERT_GT(server.port(), 0);
  Store a("127.0.0.1", server.port(), kSecret, 5s);
  Store b("127.0.0.1", server.port(), kSecret, 5s);
  a.set("k", std::string("v\0w", 3));
  EXPECT_EQ(b.get("k", 1s), std::string("v\0w", 3));  // values are bytes, not C strings
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 5), 7);
  EXPECT_EQ(b.try_get("absent"), std::nullopt);
  EXPECT_EQ(a.missing({"k", "absent"}), std::vector<std::string>{"absent"});
  a.erase("k");
  EXPECT_EQ(b.try_get("k"), std::nullopt);
}

TEST(Store, GetWaitsForAKeySetLater) {
  StoreServer server("127.0.0.1", 0, kSecret);
  Store reader("127.0.0.1", server.port(), kSecret, 5s);
  std::thread writer([&] {
    Store w("127.0.0.1", server.port(), kSecret, 5s);
    std::this_thread::sleep_for(50ms);
    w.set("late", "here");
  });
  EXPECT_EQ(reader.get("late", 5s), "here");
  writer.join();
}

TEST(Store, WaitTimesOutNamingTheMissingKeys) {
  StoreServer server("127.0.0.1", 0, kSecret);
  Store s("127.0.0.1", server.port(), kSecret, 5s);
  s.set("rank0", "x");
  try {
    s.wait({"rank0", "rank1", "rank2"}, 200ms);
    FAIL() << "expected a timeout";
  } catch (const CommTimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank1"));
    EXPECT_THAT(e.what(), HasSubstr("rank2"));
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("rank0,")));
  }
}

TEST(Store, AProcessWithTheWrongSecretIsRefused) {
  StoreServer server("127.0.0.1", 0, kSecret);
  try {
    Store intruder("127.0.0.1", server.port(), "not-the-secret", 5s);
    FAIL() << "a wrong secret must be refused";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("refused"));
    EXPECT_THAT(e.what(), HasSubstr("LOOM_JOB_SECRET"));
  }
  // The refusal does not disturb the job's own clients.
  Store ok("127.0.0.1", server.port(), kSecret, 5s);
  ok.set("still", "works");
  EXPECT_EQ(ok.get("still", 1s), "works");
}

TEST(Store, ConnectingToNothingTimesOutWithTheAddress) {
  int port = 0;
  {
    StoreServer probe("127.0.0.1", 0, kSecret);  // a port that is free once the server is gone
    port = probe.port();
  }
  try {
    Store s("127.0.0.1", port, kSecret, 300ms);
    FAIL() << "expected a timeout";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(port)));
  }
}

TEST(Store, BadPortsAreRefusedUpFront) {
  EXPECT_THROW(StoreServer("127.0.0.1", 70000, kSecret), ConfigError);
  EXPECT_THROW(Store("127.0.0.1", 0, kSecret, 100ms), ConfigError);
}

TEST(Store, JobSecretsAreLongAndDistinct) {
  auto a = make_job_secret(), b = make_job_secret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace loom::comm
