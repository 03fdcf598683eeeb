#include <algorithm>
#include <random>

#include "client/infer_request.h"
#include "client/load_stats.h"
#include "gtest/gtest.h"

namespace epserve::client {
namespace {

TEST(NearestRankPercentile, IsAlwaysASampleWithTheRightShareBelowIt) {
  std::vector<int64_t> four = {10, 20, 30, 40};
  EXPECT_EQ(NearestRankPercentile(four, 50), 20);
  EXPECT_EQ(NearestRankPercentile(four, 90), 40);
  EXPECT_EQ(NearestRankPercentile(four, 0), 10);
  EXPECT_EQ(NearestRankPercentile(four, 100), 40);
  std::mt19937_64 rng(std::random_device{}());
  for (int n : {1, 2, 7, 1000, 1001}) {
    std::vector<int64_t> s(n);
    for (auto& v : s) v = static_cast<int64_t>(rng() % 100000);
    std::sort(s.begin(), s.end());
    for (double p : {50.0, 90.0, 99.0, 99.9}) {
      const int64_t v = NearestRankPercentile(s, p);
      const auto at_or_below = std::upper_bound(s.begin(), s.end(), v) - s.begin();
      const auto below = std::lower_bound(s.begin(), s.end(), v) - s.begin();
      EXPECT_GE(at_or_below, p / 100.0 * n - 1e-9) << "n=" << n << " p=" << p;
      EXPECT_LT(below, p / 100.0 * n + 1e-9) << "n=" << n << " p=" << p;
    }
  }
}

TEST(SummarizeLatencies, SortsAndReportsTheMax) {
  std::vector<int64_t> s = {5, 1, 4, 2, 3};
  std::optional<LatencySummary> l = SummarizeLatencies(s);
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->p50_ns, 3);
  EXPECT_EQ(l->max_ns, 5);
  std::vector<int64_t> none;
  EXPECT_FALSE(SummarizeLatencies(none).has_value());
}

TEST(ParseTokenRange, AcceptsCountsAndRangesAndNamesTheBound) {
  absl::StatusOr<TokenRange> r = ParseTokenRange("16");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->min_tokens, 16);
  EXPECT_EQ(r->max_tokens, 16);
  r = ParseTokenRange("4-64");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->min_tokens, 4);
  EXPECT_EQ(r->max_tokens, 64);
  EXPECT_FALSE(ParseTokenRange("0").ok());
  EXPECT_FALSE(ParseTokenRange("9-3").ok());
  EXPECT_FALSE(ParseTokenRange("x").ok());
}

TEST(CheckInferResponse, RejectsWrongShapesAndSizes) {
  inference::ModelInferResponse resp;
  resp.set_id("a");
  auto* out = resp.add_outputs();
  out->set_name("moe_output");
  out->set_datatype("FP32");
  out->add_shape(2);
  out->add_shape(8);
  resp.add_raw_output_contents(std::string(2 * 8 * 4, '\0'));
  EXPECT_TRUE(CheckInferResponse(resp, 2, 8, "a").ok());
  EXPECT_FALSE(CheckInferResponse(resp, 3, 8, "a").ok());
  EXPECT_FALSE(CheckInferResponse(resp, 2, 8, "b").ok());
  resp.mutable_raw_output_contents(0)->pop_back();
  EXPECT_FALSE(CheckInferResponse(resp, 2, 8, "a").ok());
}

TEST(FormatStepJson, QuotesText) { EXPECT_EQ(JsonQuote("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\""); }

}  // namespace
}  // namespace epserve::client
