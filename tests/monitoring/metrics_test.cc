// Known traffic in, exact counts out: scrapes rank 0's /metrics after a fixed set of
// requests and checks the counters, the per-expert tokens and every rank's stages.

#include <map>
#include <random>
#include <regex>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/common/http_get.h"
#include "tests/e2e/reference.h"
#include "tests/e2e/server_process.h"

namespace epserve::testing {
namespace {

// Series name with labels -> value, from the text exposition format.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> m;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space != absl::string_view::npos && absl::SimpleAtod(line.substr(space + 1), &v)) {
      m[std::string(line.substr(0, space))] = v;
    }
  }
  return m;
}

// Sum of every series of `name` whose labels contain all of `must`.
double Sum(const std::map<std::string, double>& m, const std::string& name,
           std::vector<std::string> must = {}) {
  double total = 0;
  for (const auto& [series, v] : m) {
    if (series.compare(0, name.size(), name) != 0) continue;
    if (series.size() > name.size() && series[name.size()] != '{') continue;
    bool all = true;
    for (const std::string& label : must) all &= series.find(label) != std::string::npos;
    if (all) total += v;
  }
  return total;
}

TEST(Metrics, KnownTrafficGivesExactCountsAndEveryRanksStages) {
  constexpr int kRanks = 3, kGood = 20, kBad = 3, kTokens = 6, kTopK = 2;  // synthetic:tiny
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(kRanks, {"--max-batch-tokens=16"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->NewStub();
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < kGood + kBad; ++i) {
    inference::ModelInferRequest req = Request(RandomRows(kTokens, rng), kTokens);
    if (i >= kGood) req.mutable_inputs(0)->set_datatype("INT8");
    // A quarter of the good requests go to the tiny model's second MoE layer.
    if (i < kGood / 4) (*req.mutable_parameters())["layer"].set_int64_param(1);
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    ASSERT_EQ(s.ok(), i < kGood) << s.error_message();
  }
  // A batch's respond stage is recorded just after its requests are answered: scrape until
  // the last one is (at most 10 s).
  std::map<std::string, double> m;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);;) {
    const std::string text = HttpGet((*server)->metrics_address(), "/metrics");
    ASSERT_FALSE(text.empty());
    m = ParseMetrics(text);
    if (Sum(m, "epserve_stage_duration_seconds_count", {"stage=\"respond\"", "rank=\"0\""}) ==
            Sum(m, "epserve_batch_tokens_count") ||
        absl::Now() > give_up) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Sum(m, "epserve_requests_total", {"code=\"OK\""}), kGood);
  EXPECT_EQ(Sum(m, "epserve_requests_total", {"code=\"INVALID_ARGUMENT\""}), kBad);
  EXPECT_EQ(Sum(m, "epserve_requests_total"), kGood + kBad);
  EXPECT_EQ(Sum(m, "epserve_request_duration_seconds_count", {"code=\"OK\""}), kGood);
  EXPECT_EQ(Sum(m, "epserve_tokens_total"), kGood * kTokens);
  EXPECT_EQ(Sum(m, "epserve_batch_tokens_sum"), kGood * kTokens);
  EXPECT_EQ(Sum(m, "epserve_expert_tokens_total"), kGood * kTokens * kTopK);
  EXPECT_EQ(Sum(m, "epserve_expert_tokens_total", {"layer=\"1\""}), kGood / 4 * kTokens * kTopK);
  EXPECT_EQ(Sum(m, "epserve_expert_tokens_total", {"layer=\"0\""}),
            (kGood - kGood / 4) * kTokens * kTopK);
  // Every request has been answered: nothing in flight, nothing queued.
  EXPECT_EQ(Sum(m, "epserve_inflight_requests"), 0);
  EXPECT_EQ(Sum(m, "epserve_queue_tokens"), 0);
  // FP32 rows both ways: a token reaches at least one and at most k workers (with the shared
  // expert split, every worker); one row comes back per pair and, split, per row received.
  const double dispatch = Sum(m, "epserve_exchange_bytes_total", {"direction=\"dispatch\""});
  EXPECT_EQ(Sum(m, "epserve_exchange_bytes_total", {"direction=\"combine\""}),
            dispatch + kGood * kTokens * kTopK * 64 * 4);
  EXPECT_EQ(Sum(m, "epserve_worker_pairs_total"), kGood * kTokens * kTopK);
  EXPECT_GE(dispatch, kGood * kTokens * 64 * 4);
  EXPECT_LE(dispatch, kGood * kTokens * 64 * 4 * kTopK);
  const double batches = Sum(m, "epserve_batch_tokens_count");
  EXPECT_GE(batches, 1);
  for (const char* stage : {"scatter", "gather", "respond"}) {
    EXPECT_EQ(Sum(m, "epserve_stage_duration_seconds_count",
                  {"stage=\"" + std::string(stage) + "\"", "rank=\"0\""}),
              batches)
        << stage;
  }
  for (int rank = 1; rank < kRanks; ++rank) {
    for (const char* stage : {"route", "layout", "dispatch", "expert_ffn", "combine"}) {
      EXPECT_EQ(
          Sum(m, "epserve_stage_duration_seconds_count",
              {"stage=\"" + std::string(stage) + "\"", "rank=\"" + std::to_string(rank) + "\""}),
          batches)
          << stage << " rank " << rank;
    }
  }
  EXPECT_EQ(Sum(m, "epserve_workers_ready"), kRanks - 1);
  EXPECT_EQ(Sum(m, "epserve_workers_configured"), kRanks - 1);
  const double balance = Sum(m, "epserve_expert_balancedness", {"layer=\"0\""});
  EXPECT_GT(balance, 0.0);
  EXPECT_LE(balance, 1.0);
  EXPECT_GT(Sum(m, "epserve_heap_bytes"), 0);
  EXPECT_EQ(Sum(m, "epserve_build_info"), 1);
}

}  // namespace
}  // namespace epserve::testing
