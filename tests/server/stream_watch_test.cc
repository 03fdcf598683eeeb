#include <algorithm>
#include <cstdint>
#include <random>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/stream_guard.h"

namespace epserve::server {
namespace {

constexpr int64_t kBound = 4 * 256;  // the guard's: 4x --max-concurrent-streams
const absl::Duration kPass = absl::Milliseconds(100);
const absl::Duration kWindow = 100 * kPass;  // the guard's: 10 s

// One connection's stream counters as channelz keeps them, passes 100 ms apart.
class Connection {
 public:
  Connection() : at_(absl::FromUnixSeconds(1000)) {}

  void Start(int64_t n) { started_ += n; }
  void Complete(int64_t n) { completed_ = std::min(started_, completed_ + n); }
  // The next pass, `held` of the open streams held by the service.
  StreamWatch::Counts Pass(int64_t held) {
    at_ += kPass;
    StreamWatch::Counts c;
    c.at = at_;
    c.started = started_;
    c.completed = completed_;
    c.held = held;
    return c;
  }
  int64_t open() const { return started_ - completed_; }

 private:
  absl::Time at_;
  int64_t started_ = 0, completed_ = 0;
};

// A well-behaved connection under 10x overload on a starved host: thousands of streams a pass,
// 1100-1700 of them "open" beyond what the service holds for twenty seconds, because gRPC
// destroys them late. It drains, so it stays.
TEST(StreamWatch, KeepsABacklogThatDrains) {
  std::mt19937_64 rng(std::random_device{}());
  StreamWatch watch(kBound, kWindow);
  Connection conn;
  conn.Start(1400);
  int over_passes = 0;
  for (int pass = 0; pass < 200; ++pass) {
    const int64_t turnover = 500 + static_cast<int64_t>(rng() % 3000);
    const int64_t target = 1300 + static_cast<int64_t>(rng() % 600);  // open streams
    conn.Complete(turnover);
    conn.Start(std::max<int64_t>(0, target - conn.open()));
    const int64_t held = static_cast<int64_t>(rng() % 200);
    ASSERT_FALSE(watch.Observe(conn.Pass(held))) << "pass " << pass << ", open " << conn.open();
    over_passes += watch.over() ? 1 : 0;
  }
  EXPECT_GT(over_passes, 100);  // the backlog was over the bound most of the time
}

// Streams the service holds (queued up to their deadline) are not the client's fault.
TEST(StreamWatch, KeepsStreamsTheServiceHolds) {
  StreamWatch watch(kBound, kWindow);
  Connection conn;
  conn.Start(4000);
  for (int pass = 0; pass < 60; ++pass) {
    ASSERT_FALSE(watch.Observe(conn.Pass(3500))) << "pass " << pass;
  }
}

// CI's backlog: 4300 streams beyond what the service held, none destroyed for a second and a
// half while the client kept sending, then gRPC catching up. It drains, so it stays.
TEST(StreamWatch, KeepsABacklogThatStallsForSeconds) {
  std::mt19937_64 rng(std::random_device{}());
  StreamWatch watch(kBound, kWindow);
  Connection conn;
  conn.Start(4300);
  int over_passes = 0;
  for (int pass = 0; pass < 300; ++pass) {
    const bool stalled = pass % 50 < 15;  // 1.5 s of every 5 s
    conn.Start(150 + static_cast<int64_t>(rng() % 100));
    if (!stalled) conn.Complete(250 + static_cast<int64_t>(rng() % 100));
    ASSERT_FALSE(watch.Observe(conn.Pass(static_cast<int64_t>(rng() % 200))))
        << "pass " << pass << ", open " << conn.open();
    ASSERT_LE(conn.open(), 8 * kBound);  // (the ceiling is no part of this test)
    over_passes += watch.over() ? 1 : 0;
  }
  EXPECT_GT(over_passes, 250);  // over the bound most of the time
}

// A client that holds 3000 streams it never finishes (between the bound and 8x it) while a
// few others come and go: shut down once a whole window has passed, not before. (Turnover over
// the window hides held streams, a few hundred per second of it 2000 in all: the ceiling is
// what bounds a client that churns.)
TEST(StreamWatch, ShutsDownAHeldFloodAfterTheWindow) {
  std::mt19937_64 rng(std::random_device{}());
  StreamWatch watch(kBound, kWindow);
  Connection conn;
  conn.Start(3000);
  int shut_at = -1;
  for (int pass = 0; pass < 120 && shut_at < 0; ++pass) {
    const int64_t churn = static_cast<int64_t>(rng() % 10);
    conn.Start(churn);
    if (watch.Observe(conn.Pass(0))) shut_at = pass;
    conn.Complete(churn);  // the streams just started, after the pass
  }
  EXPECT_EQ(shut_at, 100);  // over from pass 0; pass 100 is a window later
}

// A flood over 8x the bound goes at the first pass; one just under it, a window later.
TEST(StreamWatch, ShutsDownFloodsOverTheCeilingAtOnce) {
  {
    StreamWatch watch(kBound, kWindow);
    Connection conn;
    conn.Start(8 * kBound + 1);
    EXPECT_TRUE(watch.Observe(conn.Pass(0)));
  }
  {
    StreamWatch watch(kBound, kWindow);
    Connection conn;
    conn.Start(8 * kBound);
    for (int pass = 0; pass < 100; ++pass) ASSERT_FALSE(watch.Observe(conn.Pass(0))) << pass;
    EXPECT_TRUE(watch.Observe(conn.Pass(0)));
  }
}

// Churning streams hides held ones from the turnover rules, but not from the ceiling.
TEST(StreamWatch, TheCeilingHoldsAgainstChurn) {
  for (const int64_t held_by_client : {int64_t{3000}, 8 * kBound + 100}) {
    StreamWatch watch(kBound, kWindow);
    Connection conn;
    conn.Start(held_by_client);
    bool shut = false;
    for (int pass = 0; pass < 40 && !shut; ++pass) {
      conn.Start(4000);
      shut = watch.Observe(conn.Pass(0));
      conn.Complete(4000);  // as many complete as started: the held ones stay
    }
    EXPECT_EQ(shut, held_by_client > 8 * kBound) << held_by_client;
  }
}

// Under the bound for one pass restarts the window.
TEST(StreamWatch, FallingUnderTheBoundRestartsTheWindow) {
  StreamWatch watch(kBound, kWindow);
  Connection conn;
  conn.Start(2000);
  for (int pass = 0; pass < 99; ++pass) ASSERT_FALSE(watch.Observe(conn.Pass(0)));
  EXPECT_FALSE(watch.Observe(conn.Pass(1500)));  // the service took most: under the bound
  EXPECT_FALSE(watch.over());
  for (int pass = 0; pass < 100; ++pass) ASSERT_FALSE(watch.Observe(conn.Pass(0))) << pass;
  EXPECT_TRUE(watch.Observe(conn.Pass(0)));
}

}  // namespace
}  // namespace epserve::server
