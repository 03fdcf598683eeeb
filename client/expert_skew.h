// Skewed expert load for epserve-load: token rows aimed at the served layer's experts with a
// stated popularity, so that expert load balancing can be measured against real-looking
// traffic (a few experts taking several times their share).
//
// The popularity: "uniform"; "zipf:S" (expert of rank r, 1-based, has weight r^-S); or
// "hot:N:Q" (N experts share a fraction Q of the choices, the rest share 1 - Q evenly). Which
// experts take which rank is a permutation drawn from the seed, so a run is reproducible and
// the hot experts are not always the first ones.
//
// A row is aimed by building it from the router: for each of its k choices (experts drawn
// without replacement from the popularity), the unit vector of that expert's router row, times
// a gain, plus uniform noise in [-1, 1). The gain is chosen once, at creation, as the smallest
// of a few that makes the reference router (model/reference.h) pick the aimed experts for at
// least 95% of sampled rows, so the choices the server makes follow the popularity closely.
// Immutable once created; Fill is thread-safe (each caller brings its own generator).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/infer_request.h"
#include "model/moe_config.h"

namespace epserve::client {

struct ExpertSkew {
  enum class Kind { kUniform, kZipf, kHotSet };
  Kind kind = Kind::kUniform;
  double exponent = 1.0;  // kZipf
  int hot_experts = 0;    // kHotSet
  double hot_share = 0;   // kHotSet, in (0, 1)
  std::string ToString() const;
};

// "uniform", "zipf:1.0", "hot:4:0.3"; INVALID_ARGUMENT naming the field and its bound.
absl::StatusOr<ExpertSkew> ParseExpertSkew(absl::string_view text);

// The probability of each of `num_experts` experts being chosen (sums to 1), ranks permuted
// by `seed`. Experts of a hot set beyond num_experts are an error caught by Create.
std::vector<double> ExpertPopularity(const ExpertSkew& skew, int num_experts, uint64_t seed);

class SkewedRows {
 public:
  // `model_spec` and `model_seed` as the server's --model and --seed (any model OpenModel
  // reads); `layer` the MoE layer aimed at (-1: the first); `seed` draws the permutation.
  static absl::StatusOr<std::unique_ptr<SkewedRows>> Create(absl::string_view model_spec,
                                                            uint64_t model_seed, int layer,
                                                            const ExpertSkew& skew, uint64_t seed);

  int64_t hidden_size() const { return cfg_.hidden_size; }
  const std::vector<double>& popularity() const { return popularity_; }
  double gain() const { return gain_; }
  // Rows that the reference router sent exactly to their aimed experts, of those sampled at
  // creation with the chosen gain.
  double aimed_fraction() const { return aimed_fraction_; }
  const model::MoeLayerConfig& config() const { return cfg_; }
  const std::vector<float>& router() const { return router_; }

  // dst [tokens, H]: each row aimed at k experts drawn from the popularity.
  void Fill(FastRng& rng, float* dst, int64_t tokens) const;

 private:
  SkewedRows() = default;
  // Draws k distinct experts from the popularity.
  void Draw(FastRng& rng, int32_t* experts) const;
  void FillWithGain(FastRng& rng, float* dst, int64_t tokens, double gain,
                    std::vector<int32_t>* aimed) const;

  model::MoeLayerConfig cfg_;
  std::vector<float> router_;       // [E, H] of the layer
  std::vector<float> unit_router_;  // rows scaled to unit length
  std::vector<double> popularity_;
  std::vector<double> cumulative_;
  double gain_ = 0;
  double aimed_fraction_ = 0;
};

}  // namespace epserve::client
