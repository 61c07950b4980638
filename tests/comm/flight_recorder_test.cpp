// The flight recorder keeps a process group's last ops (dropping the oldest) with their state, and the
// hang report names, from every rank's records, the collective a group did not complete: who waited
// in it, who completed it, who never joined and what those did last, and ranks that left no record.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "loom/comm/flight_recorder.h"
#include "loom/comm/hang_report.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

using ::testing::HasSubstr;

OpDesc collective(OpKind kind, uint64_t seq) {
  OpDesc d{};
  d.kind = kind, d.dtype = DType::F32, d.reduce = ReduceOp::kSum, d.count = 64, d.seq = seq;
  return d;
}

TEST(FlightRecorder, KeepsTheLastOpsWithTheirStates) {
  FlightRecorder f(3);
  const uint64_t a = f.add(collective(OpKind::kAllReduce, 1), -1, 0, 256);
  f.started(a);
  f.ended(a, "");
  OpDesc p2p{};
  p2p.kind = OpKind::kSendRecvMany, p2p.count = 2;
  const uint64_t b = f.add(p2p, 1, 0, 8);
  const uint64_t c = f.add(collective(OpKind::kAllGather, 2), -1, 0, 256);
  f.started(c);
  f.ended(c, "timed out");
  const uint64_t d = f.add(collective(OpKind::kAllReduce, 3), -1, 0, 256);
  f.started(d);
  f.started(a);  // dropped: ignored
  const auto r = f.snapshot();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].id, b);
  EXPECT_EQ(r[0].state, FlightRecord::State::Queued);
  EXPECT_EQ(r[1].state, FlightRecord::State::Failed);
  EXPECT_EQ(r[1].error, "timed out");
  EXPECT_EQ(r[2].state, FlightRecord::State::Running);
  EXPECT_GT(r[2].started, 0);
  EXPECT_EQ(describe_record(r[0]), "send_recv_many(2 sends and receives, first with rank 1)");
  const auto back = flight_record_from_json(flight_record_json(r[1]));
  EXPECT_EQ(back.op, describe(collective(OpKind::kAllGather, 2)));
  EXPECT_THAT(back.op, HasSubstr("all_gather(F32, 64 elements) #2"));
  EXPECT_EQ(back.state, FlightRecord::State::Failed);
  EXPECT_EQ(back.seq, 2u);
}

nlohmann::json dump(int rank, const std::string& group, std::vector<int> ranks, std::vector<FlightRecord> records) {
  nlohmann::json rs = nlohmann::json::array();
  for (const auto& r : records) rs.push_back(flight_record_json(r));
  return {{"rank", rank}, {"groups", nlohmann::json::array({{{"group", group}, {"ranks", ranks}, {"rank", rank}, {"records", rs}}})}};
}

FlightRecord rec(uint64_t id, uint64_t seq, const std::string& op, FlightRecord::State s, const std::string& error = "") {
  FlightRecord r;
  r.id = id, r.seq = seq, r.op = op, r.state = s, r.error = error;
  return r;
}

TEST(HangReport, NamesTheCollectiveAndWhoNeverJoined) {
  using S = FlightRecord::State;
  // Four ranks: 0 and 2 wait in #7, 1 stopped after #6, 3 left no record.
  const std::vector<int> ranks{0, 1, 2, 3};
  std::vector<nlohmann::json> dumps = {
      dump(0, "dp", ranks, {rec(1, 6, "all_reduce #6", S::Done), rec(2, 7, "all_reduce #7", S::Failed, "timed out: rank(s) 1, 3 never arrived")}),
      dump(1, "dp", ranks, {rec(1, 6, "all_reduce #6", S::Done), rec(2, 0, "send_recv_many(to 0)", S::Done)}),
      dump(2, "dp", ranks, {rec(1, 6, "all_reduce #6", S::Done), rec(2, 7, "all_reduce #7", S::Running)}),
      // A group that finished everything is not reported.
      dump(0, "tp", {0, 2}, {rec(1, 1, "all_gather #1", S::Done)}),
  };
  const auto hangs = analyse_hang(dumps);
  ASSERT_EQ(hangs.size(), 1u);
  const auto& h = hangs[0];
  EXPECT_EQ(h.group, "dp");
  EXPECT_EQ(h.seq, 7u);
  EXPECT_EQ(h.op, "all_reduce #7");
  EXPECT_EQ(h.waited, (std::vector<int>{0, 2}));
  EXPECT_EQ(h.never_joined, (std::vector<int>{1, 3}));
  EXPECT_EQ(h.no_record, (std::vector<int>{3}));
  const std::string text = format_hang(hangs);
  EXPECT_THAT(text, HasSubstr("entered it and waited: rank(s) 0, 2 (timed out: rank(s) 1, 3 never arrived)"));
  EXPECT_THAT(text, HasSubstr("never joined: rank 1 (its last op: send_recv_many(to 0) (done))"));
  EXPECT_THAT(text, HasSubstr("never joined: rank 3 (it left no flight record"));
  EXPECT_THAT(text, HasSubstr("the hang: rank(s) 1, 3 never joined all_reduce #7 of group dp"));
  EXPECT_THAT(format_hang({}), HasSubstr("not a hang"));
  EXPECT_THROW(analyse_hang({nlohmann::json{{"rank", 0}}}), CommError);
}

}  // namespace
}  // namespace loom::comm
