#include "client/verify.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/parallel.h"
#include "common/status.h"
#include "model/reference.h"
#include "model/synthetic.h"

namespace epserve::client {

double DefaultTolerance(common::ElementType dtype) {
  switch (dtype) {
    case common::ElementType::kFp32:
      return 1e-4;
    case common::ElementType::kBf16:
      return 1e-2;
    case common::ElementType::kFp16:
      return 2e-3;
    case common::ElementType::kFp8E4m3:  // no request dtype (kRequestDtypes)
      break;
  }
  return 1e-4;
}

absl::StatusOr<std::unique_ptr<Verifier>> Verifier::Create(absl::string_view spec, uint64_t seed,
                                                           std::optional<int64_t> layer,
                                                           common::ElementType dtype,
                                                           double tolerance) {
  if (!absl::StartsWith(spec, "synthetic:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify-model: '", spec, "' is not synthetic:<preset>; presets: ",
                     absl::StrJoin(model::SyntheticPresetNames(), ", ")));
  }
  EPSERVE_ASSIGN_OR_RETURN(std::unique_ptr<model::WeightSource> source,
                           model::OpenModel(spec, seed));
  const model::ModelConfig& config = source->config();
  const int chosen = layer.has_value() ? static_cast<int>(*layer) : config.moe_layers.front();
  if (std::find(config.moe_layers.begin(), config.moe_layers.end(), chosen) ==
      config.moe_layers.end()) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", chosen, " is not an MoE layer of ",
                                                   spec, " (",
                                                   absl::StrJoin(config.moe_layers, ","), ")"));
  }
  EPSERVE_ASSIGN_OR_RETURN(model::LayerWeights weights, model::LoadLayer(*source, chosen));
  auto v = std::unique_ptr<Verifier>(new Verifier());
  v->config_ = config.layer;
  v->weights_ = std::move(weights);
  v->layer_ = chosen;
  v->tolerance_ = tolerance > 0 ? tolerance : DefaultTolerance(dtype);
  return v;
}

absl::Status Verifier::Check(const float* x, const float* y, int64_t tokens) const {
  const int64_t h = config_.hidden_size;
  std::vector<float> want(static_cast<size_t>(tokens * h));
  // Each token's reference depends on that token alone: ranges of tokens on the host's
  // threads (a 300-token request of qwen1.5-moe-a2.7b took seconds on one).
  std::vector<double> margins(static_cast<size_t>(tokens));
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  common::ParallelFor(threads, tokens, kVerifyGrainTokens, [&](int64_t begin, int64_t end) {
    model::Routing routing;
    model::ReferenceForward(config_, weights_, x + begin * h, end - begin, &want[begin * h],
                            &routing);
    std::copy(routing.margins.begin(), routing.margins.end(), margins.begin() + begin);
  });
  double scale = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (margins[t] < kRoutingTieMargin) continue;
    for (int64_t i = 0; i < h; ++i) scale = std::max(scale, std::fabs(double{want[t * h + i]}));
  }
  if (scale == 0) return absl::OkStatus();  // every row skipped (or an all-zero answer)
  double worst = 0;
  int64_t worst_row = -1;
  for (int64_t t = 0; t < tokens; ++t) {
    if (margins[t] < kRoutingTieMargin) continue;
    double row = 0;
    for (int64_t i = 0; i < h; ++i) {
      const double d = std::fabs(double{y[t * h + i]} - double{want[t * h + i]});
      row = std::isnan(d) ? INFINITY : std::max(row, d);
    }
    if (row / scale > worst) {
      worst = row / scale;
      worst_row = t;
    }
  }
  if (worst <= tolerance_) return absl::OkStatus();
  return absl::DataLossError(absl::StrFormat(
      "row %d of %d differs from the reference forward pass by %.3g (relative to max|ref|), "
      "tolerance %.3g",
      worst_row, tokens, worst, tolerance_));
}

}  // namespace epserve::client
