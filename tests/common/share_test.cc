#include "common/share.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace epserve::common {
namespace {

static_assert(ContiguousShare(60, 0, 4).begin == 0 && ContiguousShare(60, 3, 4).end == 60);

TEST(ContiguousShare, CoversEverythingInOrderWithSizesWithinOne) {
  for (int64_t total : {0, 1, 7, 60, 64, 1407}) {
    for (int64_t parts = 1; parts <= 9; ++parts) {
      int64_t next = 0, smallest = total, largest = 0;
      for (int64_t p = 0; p < parts; ++p) {
        const Share s = ContiguousShare(total, p, parts);
        EXPECT_EQ(s.begin, next) << total << " over " << parts << ", part " << p;
        EXPECT_EQ(s.begin, ShareBegin(total, p, parts));
        next = s.end;
        smallest = std::min(smallest, s.size());
        largest = std::max(largest, s.size());
      }
      EXPECT_EQ(next, total) << total << " over " << parts;
      EXPECT_LE(largest - smallest, 1) << total << " over " << parts;
    }
  }
}

TEST(ContiguousShare, IsFloorOfTheProportion) {
  // 60 experts over 7 workers: 8, 9, 8, 9, 8, 9, 9 (w * 60 / 7 rounded down).
  const int64_t begins[] = {0, 8, 17, 25, 34, 42, 51, 60};
  for (int w = 0; w <= 7; ++w) EXPECT_EQ(ShareBegin(60, w, 7), begins[w]);
}

}  // namespace
}  // namespace epserve::common
