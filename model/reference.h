// The plain C++ reference forward pass of an MoE layer. Accumulates in double; slow by
// design. Tests compare every kernel and the whole service against it.
#pragma once

#include <cstdint>
#include <vector>

#include "model/moe_config.h"
#include "model/weights.h"

namespace epserve::model {

// The routing decision for T tokens: ids[t*k + j] and weights[t*k + j], j-th choice of
// token t, in descending order of the choosing score (ties: lower expert index first).
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  // Per token, how far the decision was from flipping: the smallest gap between a chosen
  // and an unchosen choosing score (and, for grouped routing, between a chosen and an
  // unchosen group). Tests skip exact-choice checks where it is within rounding error.
  std::vector<double> margins;
};

// Routes T tokens `x` [T, H].
Routing ReferenceRoute(const MoeLayerConfig& cfg, const LayerWeights& w, const float* x,
                       int64_t num_tokens);

// y [T, H] = the MoE layer applied to x [T, H]: the routed experts' SwiGLU FFNs weighted
// by their routing weights, plus the (optionally gated) shared expert.
void ReferenceForward(const MoeLayerConfig& cfg, const LayerWeights& w, const float* x,
                      int64_t num_tokens, float* y, Routing* routing = nullptr);

// SwiGLU FFN of one expert on one row: down(silu(gate x) * up x), double accumulation.
void ReferenceExpert(const float* gate, const float* up, const float* down, int64_t hidden,
                     int64_t ffn, const float* x, double* y_accum, double scale);

}  // namespace epserve::model
