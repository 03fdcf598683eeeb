// common/parallel: every item and byte is covered exactly once, whatever the split.
#include "common/parallel.h"

#include <atomic>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace epserve::common {
namespace {

TEST(ParallelFor, CoversEveryItemOnce) {
  std::mt19937_64 rng(std::random_device{}());
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4097}}) {
      const int64_t grain = 1 + static_cast<int64_t>(rng() % 300);
      std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
      std::atomic<int> calls{0};
      ParallelFor(threads, n, grain, [&](int64_t begin, int64_t end) {
        ++calls;
        EXPECT_LE(begin, end);
        for (int64_t i = begin; i < end; ++i) ++seen[i];
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i].load(), 1) << i;
      EXPECT_LE(calls.load(), std::max(threads, 1));
      if (n >= 2 * grain && threads > 1) {
        EXPECT_GT(calls.load(), 1) << n << " " << grain;
      }
    }
  }
}

TEST(ParallelCopy, CopiesEveryJobWhole) {
  std::mt19937_64 rng(std::random_device{}());
  // Jobs of odd sizes around the 1 MiB split, some empty.
  const std::vector<size_t> sizes = {0, 1, (1u << 20) - 3, 5, (3u << 20) + 11, 0, 4096};
  std::vector<std::vector<char>> src, dst;
  std::vector<CopyJob> jobs;
  for (size_t bytes : sizes) {
    std::vector<char>& s = src.emplace_back(bytes);
    for (char& c : s) c = static_cast<char>(rng());
    dst.emplace_back(bytes + 16, '\x5a');  // poisoned, with a guard after the copy
  }
  for (size_t i = 0; i < sizes.size(); ++i)
    jobs.push_back({dst[i].data(), src[i].data(), sizes[i]});
  for (int threads : {1, 2, 5}) {
    for (auto& d : dst) std::fill(d.begin(), d.end(), '\x5a');
    ParallelCopy(threads, jobs);
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] > 0) {  // (memcmp of an empty vector's null data is undefined)
        EXPECT_EQ(std::memcmp(dst[i].data(), src[i].data(), sizes[i]), 0) << i;
      }
      for (size_t g = sizes[i]; g < dst[i].size(); ++g) ASSERT_EQ(dst[i][g], '\x5a') << i;
    }
  }
  EXPECT_GE(DefaultCopyThreads(), 1);
  EXPECT_LE(DefaultCopyThreads(), 8);
}

}  // namespace
}  // namespace epserve::common
