// bench/bench_support.h: the round-robin timing calls its settle hook before every timed call,
// the wait for idle threads sees a spinning thread, waits it out, and gives up at its deadline
// when the thread never stops, and OpenBLAS's fallback to a core without AVX is replaced by
// the host's widest kernels.
#include "bench/bench_support.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace epserve::bench {
namespace {

// A thread that stays runnable (yielding in a loop) until Stop() or destruction.
class BusyThread {
 public:
  BusyThread()
      : thread_([this] {
          while (!stop_) std::this_thread::yield();
        }) {}
  ~BusyThread() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A core without AVX (what OpenBLAS 0.3.21 takes Sapphire Rapids for) on a host with AVX2 or
// AVX-512 becomes the kernels of its widest vectors; a core OpenBLAS knows stays its own.
TEST(CoretypeForUnknownCpuTest, ReplacesOnlyACoreWithoutAvx) {
  EXPECT_EQ(CoretypeForUnknownCpu("Cooperlake"), nullptr);
  EXPECT_EQ(CoretypeForUnknownCpu("Zen"), nullptr);
  EXPECT_EQ(CoretypeForUnknownCpu("SkylakeX"), nullptr);
#if defined(__x86_64__)
  const char* widest = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                       : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                         : nullptr;
  for (const char* core : {"Prescott", "prescott", "Nehalem", "Barcelona"}) {
    const char* got = CoretypeForUnknownCpu(core);
    if (widest == nullptr) {
      EXPECT_EQ(got, nullptr) << core;
    } else {
      ASSERT_NE(got, nullptr) << core;
      EXPECT_STREQ(got, widest) << core;
    }
  }
#else
  EXPECT_EQ(CoretypeForUnknownCpu("Prescott"), nullptr);
#endif
}

TEST(RoundRobinMedianSecondsTest, SettlesBeforeEveryTimedCallWithItsIndex) {
  std::vector<size_t> order;
  std::vector<size_t> settled;
  const std::vector<std::function<void()>> fns = {[&] { order.push_back(0); },
                                                  [&] { order.push_back(1); }};
  int reps = 0;
  const std::vector<double> med = RoundRobinMedianSeconds(
      fns, /*warmup=*/1, /*min_reps=*/3, /*max_reps=*/3, /*min_seconds=*/0.0, &reps, [&](size_t i) {
        settled.push_back(i);
        // The settle hook runs before the call it names, never inside a timed call.
        EXPECT_EQ(order.size() - 2, settled.size() - 1);
      });
  ASSERT_EQ(med.size(), 2u);
  EXPECT_EQ(reps, 3);
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 0, 1, 0, 1, 0, 1}));  // warm-up round first
  EXPECT_EQ(settled, (std::vector<size_t>{0, 1, 0, 1, 0, 1}));      // timed rounds only
}

TEST(WaitForOtherThreadsIdleTest, ReturnsAtOnceWhenNoOtherThreadRuns) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(WaitForOtherThreadsIdle(5.0));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

TEST(WaitForOtherThreadsIdleTest, WaitsForASpinningThreadToStop) {
  std::atomic<bool> spinning{true};
  std::atomic<bool> stop{false};
  std::thread spinner([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    while (std::chrono::steady_clock::now() < until) std::this_thread::yield();
    spinning = false;
    while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_TRUE(WaitForOtherThreadsIdle(30.0));
  EXPECT_FALSE(spinning.load());  // it returned only once the spinner had gone to sleep
  stop = true;
  spinner.join();
}

TEST(WaitForOtherThreadsIdleTest, GivesUpAtItsDeadline) {
  BusyThread spinner;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(WaitForOtherThreadsIdle(0.2));
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, std::chrono::milliseconds(200));
  EXPECT_LT(waited, std::chrono::seconds(20));
}

TEST(IdleThreadsWaitTest, WaitsOnlyBeforeMarkedCallsAndReportsTheWaitsThatGaveUp) {
  BusyThread spinner;
  IdleThreadsWait idle;
  const std::function<void(size_t)> hook = idle.Before({false, true});
  auto t0 = std::chrono::steady_clock::now();
  hook(0);  // not marked: no wait, whatever runs
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  testing::internal::CaptureStdout();
  idle.PrintWarningIfAny();
  EXPECT_EQ(testing::internal::GetCapturedStdout(), "");
  t0 = std::chrono::steady_clock::now();
  hook(1);  // marked: waits its second for the spinner, then gives up
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  spinner.Stop();
  testing::internal::CaptureStdout();
  idle.PrintWarningIfAny();
  EXPECT_NE(testing::internal::GetCapturedStdout().find("WARNING: 1 waits"), std::string::npos);
}

// Each run calls fn once on each of its first `count` threads, each with its own index, and
// returns only when all have finished; the threads are the same run to run, and asleep between
// runs (WaitForOtherThreadsIdle sees none running).
TEST(ThreadTeamTest, RunsEachOfItsFirstThreadsOnceAndWaitsForThem) {
  ThreadTeam team(4);
  EXPECT_EQ(team.size(), 4);
  std::vector<std::thread::id> first_ids(4);
  for (int count : {4, 1, 3, 4, 2}) {
    SCOPED_TRACE(count);
    std::vector<int> calls(4, 0);
    std::vector<std::thread::id> ids(4);
    std::atomic<int> finished{0};
    team.Run(count, [&](int t) {
      ++calls[t];
      ids[t] = std::this_thread::get_id();
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * (t + 1)));
      ++finished;
    });
    EXPECT_EQ(finished.load(), count);  // Run returned after the slowest
    for (int t = 0; t < 4; ++t) {
      EXPECT_EQ(calls[t], t < count ? 1 : 0) << "thread " << t;
      if (t >= count) continue;
      EXPECT_NE(ids[t], std::this_thread::get_id());
      if (first_ids[t] == std::thread::id()) first_ids[t] = ids[t];
      EXPECT_EQ(ids[t], first_ids[t]) << "thread " << t << " is not the one of the first runs";
    }
    EXPECT_TRUE(WaitForOtherThreadsIdle(30.0));
  }
}

// A count outside 1 .. size() is clamped: no thread runs twice, none beyond the team.
TEST(ThreadTeamTest, ClampsTheCountToTheTeam) {
  ThreadTeam team(2);
  std::vector<std::atomic<int>> calls(2);
  team.Run(5, [&](int t) { ++calls[t]; });
  team.Run(0, [&](int t) { ++calls[t]; });
  EXPECT_EQ(calls[0].load(), 2);
  EXPECT_EQ(calls[1].load(), 1);
}

}  // namespace
}  // namespace epserve::bench
