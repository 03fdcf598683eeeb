#include "gtest/gtest.h"
#include "worker/exchange_layout.h"
#include "worker/placement.h"

namespace epserve::worker {
namespace {

TEST(ExpertPlacement, EveryExpertHasExactlyOneOwnerForAnyWorkerCount) {
  for (int experts : {1, 7, 8, 60}) {
    for (int workers = 1; workers <= experts; ++workers) {
      absl::StatusOr<ExpertPlacement> p = ExpertPlacement::Contiguous(experts, workers);
      ASSERT_TRUE(p.ok());
      int total = 0, min_count = experts, max_count = 0;
      for (int w = 0; w < workers; ++w) {
        total += p->count(w);
        min_count = std::min(min_count, p->count(w));
        max_count = std::max(max_count, p->count(w));
        for (int e = p->first(w); e < p->first(w) + p->count(w); ++e) EXPECT_EQ(p->owner(e), w);
      }
      EXPECT_EQ(total, experts);
      EXPECT_GE(min_count, 1);
      EXPECT_LE(max_count - min_count, 1) << experts << " experts over " << workers;
    }
  }
}

TEST(ExpertPlacement, MoreWorkersThanExpertsIsAClearError) {
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::Contiguous(8, 9);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("num_experts=8"), absl::string_view::npos) << p.status();
}

TEST(ExchangeLayout, RegionsDoNotOverlapAndFitTheSize) {
  ExchangeShape s;
  s.num_workers = 3;
  s.num_experts = 8;
  s.top_k = 2;
  s.hidden = 64;
  s.max_batch_tokens = 100;
  EXPECT_EQ(s.max_rows_per_worker(), 34);
  EXPECT_EQ(s.max_combine_rows(), 68);
  const size_t bytes = ExchangeLayout::BytesNeeded(s);
  const size_t row = 64 * sizeof(float);
  EXPECT_GE(bytes, (34 + 100 + 68 + 100) * row);
  EXPECT_LT(bytes, (34 + 100 + 68 + 100) * row + 6 * 4096 + 100 * 5 * 4 + 4096);
}

}  // namespace
}  // namespace epserve::worker
