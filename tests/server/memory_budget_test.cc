#include "server/memory_budget.h"

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace epserve::server {
namespace {

TEST(MemoryBudget, ChargesOnlyWhatFits) {
  MemoryBudget b(100);
  EXPECT_TRUE(b.TryCharge(60));
  EXPECT_FALSE(b.TryCharge(41));  // 101 > 100: nothing charged
  EXPECT_EQ(b.used(), 60);
  EXPECT_TRUE(b.TryCharge(40));  // exactly the limit
  EXPECT_FALSE(b.TryCharge(1));
  b.Release(60);
  EXPECT_EQ(b.used(), 40);
  EXPECT_TRUE(b.TryCharge(60));
  EXPECT_EQ(b.limit(), 100);
}

// Threads charging and releasing random amounts never see more than the limit charged, and
// everything released brings the budget back to zero.
TEST(MemoryBudget, ConcurrentChargesNeverExceedTheLimit) {
  constexpr int64_t kLimit = 1 << 20;
  MemoryBudget b(kLimit);
  std::atomic<int64_t> max_seen{0};
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, seed = std::random_device{}()] {
      std::mt19937_64 rng(seed);
      std::vector<int64_t> held;
      for (int i = 0; i < 20000; ++i) {
        if (held.empty() || rng() % 2 == 0) {
          const int64_t n = 1 + static_cast<int64_t>(rng() % (kLimit / 8));
          if (b.TryCharge(n)) {
            held.push_back(n);
          } else {
            ++refused;
          }
        } else {
          b.Release(held.back());
          held.pop_back();
        }
        int64_t u = b.used(), m = max_seen.load();
        while (u > m && !max_seen.compare_exchange_weak(m, u)) {
        }
      }
      for (int64_t n : held) b.Release(n);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(max_seen.load(), kLimit);
  EXPECT_GT(refused.load(), 0) << "the test never reached the limit";
  EXPECT_EQ(b.used(), 0);
}

}  // namespace
}  // namespace epserve::server
