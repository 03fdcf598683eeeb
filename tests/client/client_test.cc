#include <algorithm>
#include <iostream>
#include <map>
#include <numeric>
#include <random>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/expert_skew.h"
#include "client/infer_request.h"
#include "client/load_generator.h"
#include "client/load_stats.h"
#include "client/server_queries.h"
#include "client/verify.h"
#include "gtest/gtest.h"
#include "model/reference.h"
#include "model/synthetic.h"

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

TEST(Dtype, Fp16RoundTripsEveryValueAndRoundsToNearestEven) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float f = Fp16ToFloat(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f))));
      continue;
    }
    ASSERT_EQ(FloatToFp16(f), h) << bits;
  }
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + 0x1p-11f)), 1.0f);                // tie to even
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);  // tie to even
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(0x1p-25f)), 0.0f);                       // tie to even
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(3 * 0x1p-25f)), 0x1p-23f);
  EXPECT_TRUE(std::isinf(Fp16ToFloat(FloatToFp16(65520.0f))));
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65519.0f)), 65504.0f);
}

TEST(Dtype, Bf16RoundsToNearestEvenAndParses) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_EQ(*ParseDtype("bf16"), common::ElementType::kBf16);
  EXPECT_EQ(*ParseDtype("FP16"), common::ElementType::kFp16);
  EXPECT_EQ(ParseDtype("int8").status().message(), "dtype: 'int8' is none of FP32, BF16, FP16");
  EXPECT_FALSE(ParseDtype("fp8").ok());  // not a request dtype
  // A value outside the enum is named as none, not as FP32.
  EXPECT_NE(common::KServeName(static_cast<common::ElementType>(99)), "FP32");
}

TEST(BuildInferRequest, EncodesTheDatatypeAndReportsTheValuesSent) {
  RequestTemplate tmpl;
  tmpl.model_name = "m";
  tmpl.hidden_size = 8;
  tmpl.timeout_us = 500;
  for (common::ElementType d : kRequestDtypes) {
    tmpl.dtype = d;
    FastRng rng(1, 2);
    inference::ModelInferRequest req;
    std::vector<float> values;
    BuildInferRequest(tmpl, 3, "id", rng, &req, &values);
    ASSERT_EQ(values.size(), 24u);
    EXPECT_EQ(req.inputs(0).datatype(), common::KServeName(d));
    EXPECT_EQ(req.parameters().at("timeout").int64_param(), 500);
    const std::string& raw = req.raw_input_contents(0);
    ASSERT_EQ(raw.size(), 24u * common::ElementBytes(d));
    for (size_t i = 0; i < values.size(); ++i) {
      float decoded;
      if (d == common::ElementType::kFp32) {
        std::memcpy(&decoded, raw.data() + 4 * i, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, raw.data() + 2 * i, 2);
        decoded = d == common::ElementType::kBf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
      }
      EXPECT_EQ(decoded, values[i]);
      EXPECT_GE(values[i], -1.0f);
      EXPECT_LE(values[i], 1.0f);
    }
    // The same bytes as an answer decode to the same values.
    inference::ModelInferResponse resp;
    auto* out = resp.add_outputs();
    out->set_name("moe_output");
    out->set_datatype(std::string(common::KServeName(d)));
    out->add_shape(3);
    out->add_shape(8);
    resp.add_raw_output_contents(raw);
    EXPECT_TRUE(CheckInferResponse(resp, 3, 8, "id", d).ok());
    EXPECT_FALSE(CheckInferResponse(resp, 3, 8, "id",
                                    d == common::ElementType::kFp32 ? common::ElementType::kBf16
                                                                    : common::ElementType::kFp32)
                     .ok());
    std::vector<float> decoded;
    DecodeOutput(resp, d, &decoded);
    EXPECT_EQ(decoded, values);
  }
}

StepReport SampleReport() {
  ThreadStats stats;
  stats.RecordOk(2'000'000, 4);
  stats.RecordOk(1'000'000, 4);
  stats.RecordError("UNAVAILABLE", "gone, \"really\"");
  StepReport r = MakeStepReport(LoadMode::kClosedLoop, 4, 0, "", stats, 1.0);
  ServerSplit split;
  split.requests = 2;
  split.queue_ms = 0.5;
  split.compute_infer_ms = 1.25;
  split.batches = 1;
  split.mean_batch_rows = 8;
  r.server = split;
  return r;
}

TEST(FormatStep, JsonAndCsvCarryTheCountsAndTheServerSplit) {
  const StepReport r = SampleReport();
  const std::string json = FormatStepJson(r);
  EXPECT_NE(json.find("\"requests\":3,\"ok\":2,\"errors\":{\"UNAVAILABLE\":1}"), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"tokens\":8"), std::string::npos) << json;
  EXPECT_NE(json.find("\"server\":{\"requests\":2,\"failed\":0,\"queue_ms\":0.500000"),
            std::string::npos)
      << json;
  const std::vector<std::string> header = absl::StrSplit(CsvHeader(), ',');
  const std::vector<std::string> row = absl::StrSplit(FormatStepCsv(r), ',');
  ASSERT_EQ(header.size(), row.size());
  std::map<std::string, std::string> cell;
  for (size_t i = 0; i < header.size(); ++i) cell[header[i]] = row[i];
  EXPECT_EQ(cell["mode"], "closed");
  EXPECT_EQ(cell["concurrency"], "4");
  EXPECT_EQ(cell["rate"], "");
  EXPECT_EQ(cell["ok"], "2");
  EXPECT_EQ(cell["errors"], "1");
  EXPECT_EQ(cell["p50_ms"], "1.000000");
  EXPECT_EQ(cell["server_compute_infer_ms"], "1.250000");
  EXPECT_EQ(cell["error_breakdown"], "UNAVAILABLE=1");
  EXPECT_NE(FormatStepTable(r).find("server (ms)"), std::string::npos);
}

TEST(PlotSvg, DrawsOnePointPerStepAndPercentile) {
  std::vector<StepReport> reports = {SampleReport(), SampleReport(), StepReport()};
  reports[1].concurrency = 16;
  reports[1].duration_seconds = 0.5;
  const std::string svg = PlotSvg(reports, "a <title>");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("a &lt;title&gt;"), std::string::npos);
  size_t circles = 0;
  for (size_t at = svg.find("<circle"); at != std::string::npos; at = svg.find("<circle", at + 1))
    ++circles;
  EXPECT_EQ(circles, 8u);  // the step without successes is left out
  EXPECT_NE(svg.find("c=16"), std::string::npos);
}

TEST(SplitBetween, TakesMeansOfTheDifferences) {
  inference::ModelStatistics before, after;
  before.mutable_inference_stats()->mutable_success()->set_count(10);
  before.mutable_inference_stats()->mutable_queue()->set_count(10);
  before.mutable_inference_stats()->mutable_queue()->set_ns(5'000'000);
  after.mutable_inference_stats()->mutable_success()->set_count(14);
  after.mutable_inference_stats()->mutable_queue()->set_count(14);
  after.mutable_inference_stats()->mutable_queue()->set_ns(13'000'000);
  after.mutable_inference_stats()->mutable_fail()->set_count(3);
  before.set_execution_count(1);
  after.set_execution_count(3);
  auto* b = after.add_batch_stats();
  b->set_batch_size(8);
  b->mutable_compute_infer()->set_count(2);
  const ServerSplit s = SplitBetween(before, after);
  EXPECT_EQ(s.requests, 4);
  EXPECT_EQ(s.failed, 3);
  EXPECT_DOUBLE_EQ(s.queue_ms, 2.0);
  EXPECT_EQ(s.batches, 2);
  EXPECT_DOUBLE_EQ(s.mean_batch_rows, 8.0);
}

TEST(Verifier, AcceptsTheReferenceAndRejectsAPerturbedAnswer) {
  absl::StatusOr<std::unique_ptr<Verifier>> v =
      Verifier::Create("synthetic:tiny", 0, std::nullopt, common::ElementType::kFp32, 0);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)->hidden_size(), 64);
  EXPECT_DOUBLE_EQ((*v)->tolerance(), 1e-4);
  auto source = model::OpenModel("synthetic:tiny", 0);
  ASSERT_TRUE(source.ok());
  auto weights = model::LoadLayer(**source, 0);
  ASSERT_TRUE(weights.ok());
  // 5 tokens: one range of the reference; 37: ranges on several threads where the host has
  // them, the wrong row in the last.
  const uint64_t seed = std::random_device{}();
  FastRng rng(seed, 4);
  for (int64_t n : {5, 37}) {
    SCOPED_TRACE(absl::StrCat(n, " tokens, seed ", seed));
    std::vector<float> x(n * 64), y(n * 64);
    rng.FillUniformSigned(x.data(), n * 64);
    model::ReferenceForward((*source)->config().layer, *weights, x.data(), n, y.data());
    EXPECT_TRUE((*v)->Check(x.data(), y.data(), n).ok());
    const int64_t wrong = n - 2;
    y[wrong * 64 + 7] += 0.01f;
    const absl::Status s = (*v)->Check(x.data(), y.data(), n);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(s.message().find(absl::StrCat("row ", wrong, " of")), std::string::npos) << s;
  }
  EXPECT_FALSE(
      Verifier::Create("/no/such/folder", 0, std::nullopt, common::ElementType::kFp32, 0).ok());
  EXPECT_FALSE(Verifier::Create("synthetic:tiny", 0, 7, common::ElementType::kFp32, 0).ok());
}

TEST(ExpertSkew, ParsesTheFormsAndNamesTheBound) {
  ASSERT_TRUE(ParseExpertSkew("uniform").ok());
  absl::StatusOr<ExpertSkew> z = ParseExpertSkew("zipf:1.2");
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->kind, ExpertSkew::Kind::kZipf);
  EXPECT_DOUBLE_EQ(z->exponent, 1.2);
  absl::StatusOr<ExpertSkew> h = ParseExpertSkew("hot:4:0.3");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->hot_experts, 4);
  EXPECT_DOUBLE_EQ(h->hot_share, 0.3);
  EXPECT_EQ(ParseExpertSkew(h->ToString())->hot_experts, 4);
  for (const char* bad : {"zipf", "zipf:-1", "hot:0:0.3", "hot:4:1.5", "hot:4", "pareto:1"}) {
    EXPECT_EQ(ParseExpertSkew(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ParseExpertSkew("hot:4:1.5").status().message().find("(0, 1)"), std::string::npos);
}

TEST(ExpertSkew, PopularityFollowsTheStatedLaw) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  ExpertSkew zipf;
  zipf.kind = ExpertSkew::Kind::kZipf;
  zipf.exponent = 1.0;
  std::vector<double> p = ExpertPopularity(zipf, 60, seed);
  EXPECT_NEAR(std::accumulate(p.begin(), p.end(), 0.0), 1.0, 1e-12);
  std::vector<double> sorted = p;
  std::sort(sorted.rbegin(), sorted.rend());
  EXPECT_NEAR(sorted[0] / sorted[1], 2.0, 1e-9);  // rank 1 : rank 2 = 2^S
  EXPECT_NEAR(sorted[0] / sorted[9], 10.0, 1e-9);
  EXPECT_EQ(ExpertPopularity(zipf, 60, seed), p);  // deterministic from the seed
  ExpertSkew hot = *ParseExpertSkew("hot:4:0.3");
  sorted = ExpertPopularity(hot, 60, seed);
  std::sort(sorted.rbegin(), sorted.rend());
  EXPECT_NEAR(std::accumulate(sorted.begin(), sorted.begin() + 4, 0.0), 0.3, 1e-12);
  EXPECT_NEAR(sorted[4], 0.7 / 56, 1e-12);
}

// Rows aimed at a hot set of the qwen shape's 60 experts: the reference router (as the server
// routes) sends them where they were aimed, so the hot set's share of the routed choices is
// the aimed share, far above uniform traffic's.
TEST(ExpertSkew, RoutedChoicesFollowTheAimedOnes) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  const std::string spec = "synthetic:qwen1.5-moe-a2.7b";
  absl::StatusOr<std::unique_ptr<SkewedRows>> rows =
      SkewedRows::Create(spec, 0, -1, *ParseExpertSkew("hot:4:0.3"), seed);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_GE((*rows)->aimed_fraction(), 0.95) << "gain " << (*rows)->gain();
  const model::MoeLayerConfig& cfg = (*rows)->config();
  const int64_t tokens = 2000;
  std::vector<float> x(static_cast<size_t>(tokens * cfg.hidden_size),
                       std::numeric_limits<float>::quiet_NaN());
  FastRng rng(seed, 7);
  (*rows)->Fill(rng, x.data(), tokens);
  ASSERT_TRUE(std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); }));
  model::LayerWeights w;
  w.router = (*rows)->router();
  const model::Routing r = model::ReferenceRoute(cfg, w, x.data(), tokens);
  std::vector<int> hot_experts;
  const std::vector<double>& p = (*rows)->popularity();
  for (int e = 0; e < cfg.num_experts; ++e) {
    if (p[e] > 0.3 / 4 - 1e-12) hot_experts.push_back(e);
  }
  ASSERT_EQ(hot_experts.size(), 4u);
  int64_t hot = 0;
  for (int32_t e : r.ids) {
    hot += std::find(hot_experts.begin(), hot_experts.end(), e) != hot_experts.end();
  }
  const double share = static_cast<double>(hot) / static_cast<double>(r.ids.size());
  std::cout << "[ skew ] gain " << (*rows)->gain() << ", aimed " << (*rows)->aimed_fraction()
            << ", hot set's share of routed choices " << share << "\n";
  // Four distinct experts per token drawn without replacement: a hot expert's marginal is a
  // little under its 7.5%; uniform traffic would give 4/60 = 6.7% to the four together.
  EXPECT_GT(share, 0.22);
  EXPECT_LT(share, 0.32);
}

}  // namespace
}  // namespace epserve::client
