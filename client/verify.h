// Checking epserve's answers against the plain C++ reference forward pass of a synthetic
// model (model/reference.h), for epserve-load --verify.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/infer_request.h"
#include "model/moe_config.h"
#include "model/weights.h"

namespace epserve::client {

// The tolerance on max|answer - reference| / max|reference| over a request's rows, per
// datatype of the answer: FP32 1e-4; BF16 and FP16 add their rounding of the output
// (2^-8 and 2^-11 relative) with margin.
double DefaultTolerance(common::ElementType dtype);

// Routing decisions closer than this to a tie (model::Routing::margins) may go either way
// in FP32 arithmetic; such rows are not compared.
inline constexpr double kRoutingTieMargin = 1e-5;

// Tokens of a request that Check's reference gives each thread at least.
inline constexpr int64_t kVerifyGrainTokens = 4;

// The reference of one served layer. Immutable once created; Check is thread-safe.
class Verifier {
 public:
  // `spec` as the server's --model (e.g. "synthetic:tiny"), `seed` as its --seed; `layer`
  // the layer requests name (nullopt: the first MoE layer, as the server does). Loads the
  // whole layer into host memory. `tolerance` <= 0 means DefaultTolerance(dtype).
  static absl::StatusOr<std::unique_ptr<Verifier>> Create(absl::string_view spec, uint64_t seed,
                                                          std::optional<int64_t> layer,
                                                          common::ElementType dtype,
                                                          double tolerance);

  int64_t hidden_size() const { return config_.hidden_size; }
  int layer() const { return layer_; }
  double tolerance() const { return tolerance_; }

  // OK when `y` [tokens, H] agrees with the reference on `x` [tokens, H] within the
  // tolerance (rows within kRoutingTieMargin of a routing tie skipped); DATA_LOSS naming
  // the worst row and its relative error otherwise.
  absl::Status Check(const float* x, const float* y, int64_t tokens) const;

 private:
  Verifier() = default;
  model::MoeLayerConfig config_;
  model::LayerWeights weights_;
  int layer_ = 0;
  double tolerance_ = 0;
};

}  // namespace epserve::client
