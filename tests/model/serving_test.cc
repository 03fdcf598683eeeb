// Served-layer selection (--layers) and per-rank memory estimates.
#include <random>

#include "gtest/gtest.h"
#include "model/layers.h"
#include "model/memory.h"
#include "model/reference.h"
#include "model/synthetic.h"

namespace epserve::model {
namespace {

// DeepSeek-V2-Lite's layout: 27 layers, layer 0 dense.
ModelConfig Lite() {
  ModelConfig c;
  c.num_layers = 27;
  for (int l = 1; l < 27; ++l) c.moe_layers.push_back(l);
  c.layer.hidden_size = 64;
  c.layer.expert_ffn_size = 32;
  c.layer.num_experts = 10;
  c.layer.top_k = 2;
  return c;
}

void ExpectError(const ModelConfig& c, absl::string_view selection,
                 std::vector<std::string> parts) {
  absl::StatusOr<std::vector<int>> got = SelectLayers(c, selection);
  ASSERT_FALSE(got.ok()) << selection;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& p : parts)
    EXPECT_NE(got.status().message().find(p), std::string::npos)
        << "'" << p << "' not in: " << got.status();
}

TEST(SelectLayers, AcceptsAllListsRangesAndMixes) {
  const ModelConfig c = Lite();
  EXPECT_EQ(*SelectLayers(c, "all"), c.moe_layers);
  EXPECT_EQ(*SelectLayers(c, "3"), (std::vector<int>{3}));
  EXPECT_EQ(*SelectLayers(c, "1,5"), (std::vector<int>{1, 5}));
  EXPECT_EQ(*SelectLayers(c, "2-7"), (std::vector<int>{2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(*SelectLayers(c, " 9, 1 ,4-5,5,26 "), (std::vector<int>{1, 4, 5, 9, 26}));
}

TEST(SelectLayers, NamesTheWrongIndexAndWhy) {
  const ModelConfig c = Lite();
  ExpectError(c, "0", {"layer 0", "dense", "MoE layers: 1-26"});
  ExpectError(c, "0-3", {"layer 0", "dense"});
  ExpectError(c, "27", {"layer 27", "beyond", "num_hidden_layers=27"});
  ExpectError(c, "5,20-40", {"layer 40", "beyond"});
  ExpectError(c, "999999999", {"layer 999999999", "beyond"});
  ExpectError(c, "7-3", {"7-3", "empty"});
  ExpectError(c, "x", {"\"x\"", "not a layer index"});
  ExpectError(c, "-1", {"\"-1\""});
  ExpectError(c, "1,,2", {"empty item"});
  ExpectError(c, "", {"empty selection"});
  ExpectError(c, "1-2-3", {"\"1-2-3\""});
}

TEST(SelectLayers, EveryOtherLayerDense) {
  ModelConfig c = Lite();
  c.num_layers = 6;
  c.moe_layers = {1, 3, 5};
  EXPECT_EQ(*SelectLayers(c, "3-3,5"), (std::vector<int>{3, 5}));
  ExpectError(c, "1-3", {"layer 2", "dense", "MoE layers: 1,3,5"});
  EXPECT_EQ(FormatLayers({1, 2, 3, 5, 7, 8}), "1-3,5,7-8");
  EXPECT_EQ(FormatLayers({}), "none");
}

TEST(ServeLayers, NarrowsTheSourceToTheSelection) {
  absl::StatusOr<std::unique_ptr<WeightSource>> tiny = OpenModel("synthetic:tiny", 3);
  ASSERT_TRUE(tiny.ok());
  absl::StatusOr<std::unique_ptr<WeightSource>> one = ServeLayers(*std::move(tiny), "1");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)->config().moe_layers, (std::vector<int>{1}));
  std::vector<float> dst(ShapeOf((*one)->config().layer, TensorKind::kRouter).numel());
  EXPECT_TRUE((*one)->Fill(1, TensorKind::kRouter, 0, dst.data()).ok());
  EXPECT_EQ((*one)->Fill(0, TensorKind::kRouter, 0, dst.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_FALSE(ServeLayers(*OpenModel("synthetic:tiny", 3), "2").ok());
}

TEST(SharedExpertSlice, SlicesAddUpToTheWholeSharedExpert) {
  absl::StatusOr<std::unique_ptr<WeightSource>> tiny = OpenModel("synthetic:tiny", 5);
  ASSERT_TRUE(tiny.ok());
  const MoeLayerConfig& c = (*tiny)->config().layer;  // shared F = 64
  const int64_t h = c.hidden_size;
  absl::StatusOr<LayerWeights> whole = LoadLayer(**tiny, 1);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  std::vector<float> x(h);
  for (float& v : x) v = normal(rng);
  std::vector<double> expected(h, 0.0);
  ReferenceExpert(whole->shared_gate.data(), whole->shared_up.data(), whole->shared_down.data(), h,
                  c.shared_ffn_size, x.data(), expected.data(), 1.0);
  for (int parts : {1, 2, 3, 64}) {
    std::vector<double> sum(h, 0.0);
    int64_t width_sum = 0;
    for (int part = 0; part < parts; ++part) {
      absl::StatusOr<std::unique_ptr<WeightSource>> slice = SharedExpertSlice(**tiny, part, parts);
      ASSERT_TRUE(slice.ok()) << slice.status();
      const MoeLayerConfig& sc = (*slice)->config().layer;
      width_sum += sc.shared_ffn_size;
      absl::StatusOr<LayerWeights> w = LoadLayer(**slice, 1);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ(w->router, whole->router);  // everything else as the source gives it
      EXPECT_EQ(w->gate[3], whole->gate[3]);
      EXPECT_EQ(w->shared_expert_gate, whole->shared_expert_gate);
      ReferenceExpert(w->shared_gate.data(), w->shared_up.data(), w->shared_down.data(), h,
                      sc.shared_ffn_size, x.data(), sum.data(), 1.0);
    }
    EXPECT_EQ(width_sum, c.shared_ffn_size) << parts << " parts";
    for (int64_t i = 0; i < h; ++i) {
      EXPECT_NEAR(sum[i], expected[i], 1e-9 * (1.0 + std::abs(expected[i])))
          << "column " << i << ", " << parts << " parts";
    }
  }
  for (auto [part, parts] : {std::pair{0, 0}, {2, 2}, {-1, 2}, {0, 65}}) {
    absl::StatusOr<std::unique_ptr<WeightSource>> bad = SharedExpertSlice(**tiny, part, parts);
    ASSERT_FALSE(bad.ok()) << part << " of " << parts;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("intermediate size (64)"), std::string::npos)
        << bad.status();
  }
}

TEST(EstimateRankBytes, CountsRouterOwnedExpertsAndSharedExpert) {
  ModelConfig c = Lite();
  c.moe_layers = {1, 2};
  c.layer.shared_ffn_size = 48;
  c.layer.shared_expert_gate = true;
  const int64_t h = 64, f = 32, e = 10;
  const int64_t router = 2 * e * h;
  const int64_t expert = 3 * f * h;
  const int64_t shared = 2 * (3 * 48 * h + h);
  // 10 experts over 3 workers: 3, 3, 4 (worker/'s contiguous placement).
  const int counts[] = {3, 3, 4};
  const int firsts[] = {0, 3, 6};
  for (int w = 0; w < 3; ++w) {
    absl::StatusOr<RankMemory> m = EstimateRankBytes(c, 3, w);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->first_expert, firsts[w]);
    EXPECT_EQ(m->num_experts, counts[w]);
    EXPECT_EQ(m->num_layers, 2);
    EXPECT_EQ(m->router_params, router);
    EXPECT_EQ(m->expert_params, 2 * counts[w] * expert);
    EXPECT_EQ(m->shared_params, shared);
    EXPECT_EQ(m->fp32_bytes(), 4 * (router + 2 * counts[w] * expert + shared));
    EXPECT_EQ(m->bf16_bytes(), 2 * (router + 2 * counts[w] * expert + shared));
    // Split: 16 of the 48 shared columns each (and the whole gate vector).
    absl::StatusOr<RankMemory> split = EstimateRankBytes(c, 3, w, /*shared_split=*/true);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ(split->shared_params, 2 * (3 * 16 * h + h));
    EXPECT_EQ(split->expert_params, m->expert_params);
  }
  // DeepSeek-V3 routing adds the per-expert correction bias to the router.
  c.layer.routing = RoutingKind::kSigmoidGroupedTopK;
  EXPECT_EQ(EstimateRankBytes(c, 1, 0)->router_params, 2 * (e * h + e));
  EXPECT_EQ(EstimateRankBytes(c, 1, 0)->expert_params, 2 * e * expert);
  EXPECT_FALSE(EstimateRankBytes(c, 0, 0).ok());
  EXPECT_FALSE(EstimateRankBytes(c, 11, 0).ok());
  EXPECT_FALSE(EstimateRankBytes(c, 2, 2).ok());
  EXPECT_FALSE(EstimateRankBytes(c, 2, -1).ok());
}

TEST(CheckHostMemory, CountsEachWorkersWeightsAndEveryRanksHeap) {
  ModelConfig c = Lite();
  c.moe_layers = {1};
  // Rank 0 (the front-end) and ranks 1, 2 (workers 0, 1) of 2 workers on this host.
  const HostRank ranks[] = {
      {.rank = 0, .worker = -1}, {.rank = 1, .worker = 0}, {.rank = 2, .worker = 1}};
  HostMemoryCheck check{.config = &c, .num_workers = 2, .heap_bytes = 1000};
  int64_t need = 3 * 1000;
  for (int w = 0; w < 2; ++w) need += EstimateRankBytes(c, 2, w)->fp32_bytes();
  check.limit_bytes = need;
  EXPECT_TRUE(CheckHostMemory(check, ranks).ok());
  check.limit_bytes = need - 1;
  const absl::Status s = CheckHostMemory(check, ranks);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("FP32 weights: rank 1 "), std::string::npos) << s;
  EXPECT_NE(s.message().find("per rank x 3) but --memory-limit is"), std::string::npos) << s;
  // BF16 weights halve what they need, the router aside (it stays FP32).
  check.weight_dtype = common::ElementType::kBf16;
  EXPECT_TRUE(CheckHostMemory(check, ranks).ok());
  // 0: the machine's memory, which these few bytes fit.
  check.limit_bytes = 0;
  EXPECT_TRUE(CheckHostMemory(check, ranks).ok());
}

TEST(EstimateRankBytes, RealModelScale) {
  // Mixtral-8x7B, 32 layers, 8 workers: one expert each = 32 * 3 * 14336 * 4096 parameters.
  absl::StatusOr<ModelConfig> c = SyntheticPreset("mixtral-8x7b");
  ASSERT_TRUE(c.ok());
  c->moe_layers.clear();
  for (int l = 0; l < 32; ++l) c->moe_layers.push_back(l);
  absl::StatusOr<RankMemory> m = EstimateRankBytes(*c, 8, 7);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->expert_params, int64_t{32} * 3 * 14336 * 4096);
  EXPECT_EQ(FormatBytes(m->bf16_bytes()), "10.5 GiB");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
}

}  // namespace
}  // namespace epserve::model
