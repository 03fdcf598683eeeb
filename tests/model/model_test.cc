#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "model/reference.h"
#include "model/synthetic.h"

namespace epserve::model {
namespace {

TEST(Synthetic, PresetsValidateAndKeepRealShapes) {
  for (const std::string& name : SyntheticPresetNames()) {
    absl::StatusOr<ModelConfig> c = SyntheticPreset(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_TRUE(c->layer.Validate().ok()) << name << ": " << c->layer.Validate();
    EXPECT_FALSE(c->moe_layers.empty()) << name;
  }
  absl::StatusOr<ModelConfig> qwen = SyntheticPreset("qwen1.5-moe-a2.7b");
  ASSERT_TRUE(qwen.ok());
  EXPECT_EQ(qwen->layer.hidden_size, 2048);
  EXPECT_EQ(qwen->layer.expert_ffn_size, 1408);
  EXPECT_EQ(qwen->layer.num_experts, 60);
  EXPECT_EQ(qwen->layer.top_k, 4);
  EXPECT_EQ(qwen->layer.shared_ffn_size, 5632);
  EXPECT_TRUE(qwen->layer.shared_expert_gate);
  absl::StatusOr<ModelConfig> mixtral = SyntheticPreset("mixtral-8x7b");
  ASSERT_TRUE(mixtral.ok());
  EXPECT_EQ(mixtral->layer.hidden_size, 4096);
  EXPECT_EQ(mixtral->layer.expert_ffn_size, 14336);
  EXPECT_EQ(mixtral->layer.num_experts, 8);
  EXPECT_EQ(mixtral->layer.top_k, 2);
}

TEST(Synthetic, UnknownPresetListsPresets) {
  absl::StatusOr<std::unique_ptr<WeightSource>> m = OpenModel("synthetic:nope", 0);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("tiny"), std::string::npos) << m.status();
  // Anything else names a checkpoint folder: a missing one is NOT_FOUND naming config.json.
  absl::Status folder = OpenModel("/some/folder", 0).status();
  EXPECT_EQ(folder.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(folder.message().find("/some/folder/config.json"), std::string::npos) << folder;
  EXPECT_EQ(OpenModel("", 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Synthetic, WeightsArePureFunctionsOfSeedLayerTensorExpert) {
  absl::StatusOr<ModelConfig> c = SyntheticPreset("tiny");
  ASSERT_TRUE(c.ok());
  SyntheticWeights a(*c, 7), b(*c, 7), other_seed(*c, 8);
  const int64_t n = ShapeOf(c->layer, TensorKind::kExpertGate).numel();
  std::vector<float> x(n, NAN), y(n, NAN), z(n, NAN), e1(n, NAN), l1(n, NAN);
  ASSERT_TRUE(a.Fill(0, TensorKind::kExpertGate, 3, x.data()).ok());
  ASSERT_TRUE(b.Fill(0, TensorKind::kExpertGate, 3, y.data()).ok());
  ASSERT_TRUE(other_seed.Fill(0, TensorKind::kExpertGate, 3, z.data()).ok());
  ASSERT_TRUE(a.Fill(0, TensorKind::kExpertGate, 4, e1.data()).ok());
  ASSERT_TRUE(a.Fill(1, TensorKind::kExpertGate, 3, l1.data()).ok());
  EXPECT_EQ(x, y);
  EXPECT_NE(x, z);
  EXPECT_NE(x, e1);
  EXPECT_NE(x, l1);
  const float bound = 1.0f / std::sqrt(static_cast<float>(c->layer.hidden_size));
  double mean = 0;
  for (float v : x) {
    ASSERT_TRUE(std::isfinite(v));
    ASSERT_LE(std::abs(v), bound);
    mean += v;
  }
  EXPECT_LT(std::abs(mean / n), 0.1 * bound);
  EXPECT_FALSE(a.Fill(0, TensorKind::kExpertGate, 8, x.data()).ok());
}

// A layer with 4 experts, hidden 2, whose router logits for x = (1, 0) are the router's
// first column.
LayerWeights TinyRouterLayer(const MoeLayerConfig& c, std::vector<float> first_column) {
  LayerWeights w;
  w.router.assign(c.num_experts * c.hidden_size, 0.0f);
  for (int e = 0; e < c.num_experts; ++e) w.router[e * c.hidden_size] = first_column[e];
  return w;
}

MoeLayerConfig RouterOnly(int experts, int k) {
  MoeLayerConfig c;
  c.hidden_size = 2;
  c.expert_ffn_size = 1;
  c.num_experts = experts;
  c.top_k = k;
  return c;
}

TEST(ReferenceRoute, SoftmaxTopKWithAndWithoutRenormalisation) {
  MoeLayerConfig c = RouterOnly(4, 2);
  LayerWeights w = TinyRouterLayer(c, {0.5f, 2.0f, -1.0f, 1.0f});
  const float x[2] = {1.0f, 0.0f};
  const double z = std::exp(0.5) + std::exp(2.0) + std::exp(-1.0) + std::exp(1.0);
  Routing r = ReferenceRoute(c, w, x, 1);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(r.weights[0], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(1.0) / z, 1e-6);
  EXPECT_NEAR(r.margins[0], (std::exp(1.0) - std::exp(0.5)) / z, 1e-9);
  c.norm_topk_prob = true;
  r = ReferenceRoute(c, w, x, 1);
  EXPECT_NEAR(r.weights[0], std::exp(2.0) / (std::exp(2.0) + std::exp(1.0)), 1e-6);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 1.0, 1e-6);
}

TEST(ReferenceRoute, TiesBreakToTheLowerExpert) {
  MoeLayerConfig c = RouterOnly(4, 2);
  LayerWeights w = TinyRouterLayer(c, {1.0f, 3.0f, 3.0f, 3.0f});
  const float x[2] = {1.0f, 0.0f};
  Routing r = ReferenceRoute(c, w, x, 1);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.margins[0], 0.0);
}

TEST(ReferenceRoute, TopKThenSoftmax) {
  MoeLayerConfig c = RouterOnly(4, 2);
  c.routing = RoutingKind::kTopKSoftmax;
  LayerWeights w = TinyRouterLayer(c, {0.5f, 2.0f, -1.0f, 1.0f});
  const float x[2] = {1.0f, 0.0f};
  Routing r = ReferenceRoute(c, w, x, 1);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(r.weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(-1.0) / (1.0 + std::exp(-1.0)), 1e-6);
}

TEST(ReferenceRoute, SigmoidGroupedBiasChoosesButDoesNotWeigh) {
  // 8 experts in 4 groups of 2; keep 2 groups; top-2; renormalised, times 2.
  MoeLayerConfig c = RouterOnly(8, 2);
  c.routing = RoutingKind::kSigmoidGroupedTopK;
  c.n_group = 4;
  c.topk_group = 2;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.0f;
  LayerWeights w = TinyRouterLayer(c, {3.0f, -1.0f, 1.0f, 1.0f, 0.0f, 0.0f, -2.0f, -2.0f});
  auto s = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  const float x[2] = {1.0f, 0.0f};
  // No bias. Group scores: g0 = s(3)+s(-1) = 1.22, g1 = 2 s(1) = 1.46, g2 = 1.0, g3 = 0.24.
  // Kept: g1, g0. Top-2 of {0..3}: expert 0 (s(3)), then 2 and 3 tie at s(1): 2.
  w.router_bias.assign(8, 0.0f);
  Routing r = ReferenceRoute(c, w, x, 1);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 2}));
  EXPECT_NEAR(r.weights[0], 2.0 * s(3) / (s(3) + s(1)), 1e-6);
  EXPECT_NEAR(r.weights[1], 2.0 * s(1) / (s(3) + s(1)), 1e-6);
  // A bias of 0.8 on experts 6 and 7 lifts g3 to 2 (s(-2) + 0.8) = 1.84: kept g3, g1, and
  // experts 6, 7 win on biased scores, but are weighed by their unbiased s(-2) (equal).
  w.router_bias = {0, 0, 0, 0, 0, 0, 0.8f, 0.8f};
  r = ReferenceRoute(c, w, x, 1);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{6, 7}));
  EXPECT_NEAR(r.weights[0], 1.0, 1e-6);
  EXPECT_NEAR(r.weights[1], 1.0, 1e-6);
  // Without renormalisation the unbiased scores show through.
  c.norm_topk_prob = false;
  r = ReferenceRoute(c, w, x, 1);
  EXPECT_NEAR(r.weights[0], 2.0 * s(-2), 1e-6);
}

TEST(ReferenceForward, MatchesAHandComputedExpert) {
  // One expert, k = 1, hidden 2, ffn 1: y = w * down * silu(gate.x) * (up.x).
  MoeLayerConfig c = RouterOnly(1, 1);
  LayerWeights w;
  w.router = {0.3f, 0.1f};
  w.gate = {{0.5f, -1.0f}};
  w.up = {{2.0f, 1.0f}};
  w.down = {{1.5f, -0.5f}};
  const float x[2] = {1.0f, 2.0f};
  float y[2] = {NAN, NAN};
  ReferenceForward(c, w, x, 1, y);
  const double g = 0.5 - 2.0, u = 2.0 + 2.0;
  const double act = g / (1.0 + std::exp(-g)) * u;
  EXPECT_NEAR(y[0], 1.5 * act, 1e-6);
  EXPECT_NEAR(y[1], -0.5 * act, 1e-6);
}

}  // namespace
}  // namespace epserve::model
