#include "client/expert_skew.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "model/weights.h"

namespace epserve::client {
namespace {

// Gains tried at creation, in units of the noise's standard deviation times sqrt(H) (the
// noise's norm): the aimed component then dominates each aimed logit by about that factor.
constexpr double kGains[] = {0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
constexpr int kCalibrationRows = 512;
constexpr double kWantAimed = 0.95;

absl::Status Bad(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("expert skew '", text.substr(0, 64), "': ", why,
                                                 " (forms: uniform, zipf:S, hot:N:Q)"));
}

}  // namespace

std::string ExpertSkew::ToString() const {
  switch (kind) {
    case Kind::kUniform:
      return "uniform";
    case Kind::kZipf:
      return absl::StrFormat("zipf:%g", exponent);
    case Kind::kHotSet:
      return absl::StrFormat("hot:%d:%g", hot_experts, hot_share);
  }
  return "?";
}

absl::StatusOr<ExpertSkew> ParseExpertSkew(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  ExpertSkew s;
  if (parts[0] == "uniform" && parts.size() == 1) return s;
  if (parts[0] == "zipf" && parts.size() == 2) {
    s.kind = ExpertSkew::Kind::kZipf;
    if (!absl::SimpleAtod(parts[1], &s.exponent) || !(s.exponent >= 0 && s.exponent <= 10)) {
      return Bad(text, "the Zipf exponent S must be a number in [0, 10]");
    }
    return s;
  }
  if (parts[0] == "hot" && parts.size() == 3) {
    s.kind = ExpertSkew::Kind::kHotSet;
    if (!absl::SimpleAtoi(parts[1], &s.hot_experts) || s.hot_experts < 1) {
      return Bad(text, "the hot set's size N must be an integer >= 1");
    }
    if (!absl::SimpleAtod(parts[2], &s.hot_share) || !(s.hot_share > 0 && s.hot_share < 1)) {
      return Bad(text, "the hot set's share Q must be a number in (0, 1)");
    }
    return s;
  }
  return Bad(text, "unknown form");
}

std::vector<double> ExpertPopularity(const ExpertSkew& skew, int num_experts, uint64_t seed) {
  std::vector<double> by_rank(num_experts, 1.0 / num_experts);
  if (skew.kind == ExpertSkew::Kind::kZipf) {
    for (int r = 0; r < num_experts; ++r) by_rank[r] = std::pow(r + 1.0, -skew.exponent);
  } else if (skew.kind == ExpertSkew::Kind::kHotSet) {
    const int hot = std::min(skew.hot_experts, num_experts);
    const int cold = num_experts - hot;
    for (int r = 0; r < num_experts; ++r) {
      by_rank[r] = r < hot ? skew.hot_share / hot : (1.0 - skew.hot_share) / std::max(cold, 1);
    }
  }
  const double total = std::accumulate(by_rank.begin(), by_rank.end(), 0.0);
  std::vector<int> expert_of_rank(num_experts);
  std::iota(expert_of_rank.begin(), expert_of_rank.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(expert_of_rank.begin(), expert_of_rank.end(), rng);
  std::vector<double> p(num_experts);
  for (int r = 0; r < num_experts; ++r) p[expert_of_rank[r]] = by_rank[r] / total;
  return p;
}

absl::StatusOr<std::unique_ptr<SkewedRows>> SkewedRows::Create(absl::string_view model_spec,
                                                               uint64_t model_seed, int layer,
                                                               const ExpertSkew& skew,
                                                               uint64_t seed) {
  EPSERVE_ASSIGN_OR_RETURN(std::unique_ptr<model::WeightSource> source,
                           model::OpenModel(model_spec, model_seed));
  const model::ModelConfig& config = source->config();
  const int chosen = layer >= 0 ? layer : config.moe_layers.front();
  if (std::find(config.moe_layers.begin(), config.moe_layers.end(), chosen) ==
      config.moe_layers.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", chosen, " is not an MoE layer of ", model_spec));
  }
  auto rows = std::unique_ptr<SkewedRows>(new SkewedRows());
  rows->cfg_ = config.layer;
  const int e_count = rows->cfg_.num_experts;
  const int64_t h = rows->cfg_.hidden_size;
  if (skew.kind == ExpertSkew::Kind::kHotSet && skew.hot_experts >= e_count) {
    return absl::InvalidArgumentError(absl::StrCat("expert skew '", skew.ToString(),
                                                   "': the hot set must be smaller than the ",
                                                   e_count, " experts of ", model_spec));
  }
  model::LayerWeights w;
  w.router.resize(static_cast<size_t>(e_count * h));
  EPSERVE_RETURN_IF_ERROR(source->Fill(chosen, model::TensorKind::kRouter, 0, w.router.data()));
  const int64_t bias = model::ShapeOf(rows->cfg_, model::TensorKind::kRouterBias).numel();
  if (bias > 0) {
    w.router_bias.resize(static_cast<size_t>(bias));
    EPSERVE_RETURN_IF_ERROR(
        source->Fill(chosen, model::TensorKind::kRouterBias, 0, w.router_bias.data()));
  }
  rows->router_ = w.router;
  rows->unit_router_ = w.router;
  for (int e = 0; e < e_count; ++e) {
    float* row = &rows->unit_router_[static_cast<size_t>(e * h)];
    double norm = 0;
    for (int64_t i = 0; i < h; ++i) norm += double{row[i]} * row[i];
    const double scale = norm > 0 ? 1.0 / std::sqrt(norm) : 0.0;
    for (int64_t i = 0; i < h; ++i) row[i] = static_cast<float>(row[i] * scale);
  }
  rows->popularity_ = ExpertPopularity(skew, e_count, seed);
  rows->cumulative_.resize(e_count);
  std::partial_sum(rows->popularity_.begin(), rows->popularity_.end(), rows->cumulative_.begin());

  // The smallest gain whose rows the reference router sends to their aimed experts.
  FastRng rng(seed, 0x5eed);
  std::vector<float> x(static_cast<size_t>(kCalibrationRows * h));
  std::vector<int32_t> aimed;
  for (double g : kGains) {
    rows->FillWithGain(rng, x.data(), kCalibrationRows, g, &aimed);
    const model::Routing r = model::ReferenceRoute(rows->cfg_, w, x.data(), kCalibrationRows);
    const int k = rows->cfg_.top_k;
    int hits = 0;
    for (int t = 0; t < kCalibrationRows; ++t) {
      std::vector<int32_t> want(aimed.begin() + t * k, aimed.begin() + (t + 1) * k);
      std::vector<int32_t> got(r.ids.begin() + t * k, r.ids.begin() + (t + 1) * k);
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      hits += want == got;
    }
    rows->gain_ = g;
    rows->aimed_fraction_ = static_cast<double>(hits) / kCalibrationRows;
    if (rows->aimed_fraction_ >= kWantAimed) break;
  }
  return rows;
}

void SkewedRows::Draw(FastRng& rng, int32_t* experts) const {
  const int k = cfg_.top_k;
  for (int j = 0; j < k; ++j) {
    // Rejection of experts already drawn keeps the draw without replacement.
    for (;;) {
      const double u = rng.UniformUnit() * cumulative_.back();
      const int e = static_cast<int>(std::upper_bound(cumulative_.begin(), cumulative_.end(), u) -
                                     cumulative_.begin());
      const int32_t pick = std::min(e, cfg_.num_experts - 1);
      if (std::find(experts, experts + j, pick) == experts + j) {
        experts[j] = pick;
        break;
      }
    }
  }
}

void SkewedRows::FillWithGain(FastRng& rng, float* dst, int64_t tokens, double gain,
                              std::vector<int32_t>* aimed) const {
  const int k = cfg_.top_k;
  const int64_t h = cfg_.hidden_size;
  // Uniform noise in [-1, 1) has standard deviation 1/sqrt(3): its norm is about sqrt(H/3).
  const float scale = static_cast<float>(gain * std::sqrt(h / 3.0));
  std::vector<int32_t> chosen(static_cast<size_t>(k));
  if (aimed != nullptr) aimed->resize(static_cast<size_t>(tokens * k));
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = dst + t * h;
    rng.FillUniformSigned(row, h);
    Draw(rng, chosen.data());
    for (int j = 0; j < k; ++j) {
      const float* u = &unit_router_[static_cast<size_t>(chosen[j] * h)];
      for (int64_t i = 0; i < h; ++i) row[i] += scale * u[i];
      if (aimed != nullptr) (*aimed)[t * k + j] = chosen[j];
    }
  }
}

void SkewedRows::Fill(FastRng& rng, float* dst, int64_t tokens) const {
  FillWithGain(rng, dst, tokens, gain_, nullptr);
}

}  // namespace epserve::client
