// common/parallel: every item and byte is covered exactly once, whatever the split.
#include "common/parallel.h"

#include "common/convert.h"
#include "common/half.h"

#include <atomic>
#include <bit>
#include <cstdint>
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

// Jobs of each pair of types a request's rows take into and out of the heap, split at odd
// places: every element converted exactly as one Convert of the whole job does (the
// element conversions themselves: validation_test's and client_test's Dtype tests), nothing
// written beyond a job's end.
TEST(ParallelConvert, ConvertsEveryJobWholeAsOneCallDoes) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  struct Pair {
    ElementType from, to;
  };
  const Pair pairs[] = {{ElementType::kBf16, ElementType::kFp32},
                        {ElementType::kFp16, ElementType::kFp32},
                        {ElementType::kFp32, ElementType::kFp32},
                        {ElementType::kFp32, ElementType::kBf16},
                        {ElementType::kFp32, ElementType::kFp16}};
  const std::vector<size_t> counts = {0, 1, (1u << 18) - 3, 5, (3u << 18) + 11};
  for (const Pair& p : pairs) {
    std::vector<std::vector<char>> src, dst, want;
    std::vector<ConvertJob> jobs;
    for (size_t n : counts) {
      std::vector<float> values(n);
      for (float& v : values) v = u(rng);
      std::vector<char>& s = src.emplace_back(n * ElementBytes(p.from));
      FromFp32(p.from, values.data(), s.data(), n);
      dst.emplace_back(n * ElementBytes(p.to) + 16, '\x5a');
      want.emplace_back(n * ElementBytes(p.to));
      Convert({want.back().data(), p.to, s.data(), p.from, n});
    }
    for (size_t i = 0; i < counts.size(); ++i)
      jobs.push_back({dst[i].data(), p.to, src[i].data(), p.from, counts[i]});
    for (int threads : {1, 2, 5}) {
      for (auto& d : dst) std::fill(d.begin(), d.end(), '\x5a');
      ParallelConvert(threads, jobs);
      for (size_t i = 0; i < counts.size(); ++i) {
        if (counts[i] > 0) {
          ASSERT_EQ(std::memcmp(dst[i].data(), want[i].data(), want[i].size()), 0)
              << FlagName(p.from) << " to " << FlagName(p.to) << ", job " << i << ", " << threads
              << " threads";
        }
        for (size_t g = want[i].size(); g < dst[i].size(); ++g) ASSERT_EQ(dst[i][g], '\x5a') << i;
      }
    }
  }
}

// The loops over rows give the scalar conversions' bits (common/half.h) for every kind of
// value: random bit patterns (NaNs, infinities, subnormals, ties among them) and the edges,
// at unaligned 16-bit addresses too.
TEST(Convert, RowLoopsHaveTheScalarConversionsBits) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<float> values;
  for (int i = 0; i < 100000; ++i)
    values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (uint32_t bits :
       {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
        0x7F800001u, 0xFFA00000u, 0x00000001u, 0x80000000u, 0x00000000u, 0x7F7F8000u}) {
    values.push_back(std::bit_cast<float>(bits));
  }
  const size_t n = values.size();
  for (const ElementType t : {ElementType::kBf16, ElementType::kFp16}) {
    std::vector<char> narrow(2 * n + 1, '\x5a');
    FromFp32(t, values.data(), narrow.data() + 1, n);  // odd address
    std::vector<float> wide(n);
    ToFp32(t, narrow.data() + 1, wide.data(), n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t got;
      std::memcpy(&got, narrow.data() + 1 + 2 * i, 2);
      const uint16_t want =
          t == ElementType::kBf16 ? FloatToBf16(values[i]) : FloatToFp16(values[i]);
      ASSERT_EQ(got, want) << "value bits " << std::hex << std::bit_cast<uint32_t>(values[i]);
      const float back = t == ElementType::kBf16 ? Bf16ToFloat(want) : Fp16ToFloat(want);
      ASSERT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(back)) << i;
    }
  }
}

}  // namespace
}  // namespace epserve::common
