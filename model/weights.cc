#include "model/weights.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace epserve::model {

absl::string_view TensorKindName(TensorKind kind) {
  switch (kind) {
    case TensorKind::kRouter:
      return "router";
    case TensorKind::kRouterBias:
      return "router_bias";
    case TensorKind::kExpertGate:
      return "expert_gate";
    case TensorKind::kExpertUp:
      return "expert_up";
    case TensorKind::kExpertDown:
      return "expert_down";
    case TensorKind::kSharedGate:
      return "shared_gate";
    case TensorKind::kSharedUp:
      return "shared_up";
    case TensorKind::kSharedDown:
      return "shared_down";
    case TensorKind::kSharedExpertGate:
      return "shared_expert_gate";
  }
  return "unknown";
}

TensorShape ShapeOf(const MoeLayerConfig& c, TensorKind kind) {
  switch (kind) {
    case TensorKind::kRouter:
      return {c.num_experts, c.hidden_size};
    case TensorKind::kRouterBias:
      return {c.routing == RoutingKind::kSigmoidGroupedTopK ? 1 : 0, c.num_experts};
    case TensorKind::kExpertGate:
    case TensorKind::kExpertUp:
      return {c.expert_ffn_size, c.hidden_size};
    case TensorKind::kExpertDown:
      return {c.hidden_size, c.expert_ffn_size};
    case TensorKind::kSharedGate:
    case TensorKind::kSharedUp:
      return {c.shared_ffn_size, c.hidden_size};
    case TensorKind::kSharedDown:
      return {c.shared_ffn_size > 0 ? c.hidden_size : 0, c.shared_ffn_size};
    case TensorKind::kSharedExpertGate:
      return {c.shared_expert_gate ? 1 : 0, c.hidden_size};
  }
  return {};
}

absl::StatusOr<LayerWeights> LoadLayer(const WeightSource& source, int layer) {
  const MoeLayerConfig& c = source.config().layer;
  LayerWeights w;
  auto load = [&](TensorKind kind, int expert, std::vector<float>& dst) -> absl::Status {
    dst.assign(ShapeOf(c, kind).numel(), 0.0f);
    if (dst.empty()) return absl::OkStatus();
    return source.Fill(layer, kind, expert, dst.data());
  };
  absl::Status s = load(TensorKind::kRouter, 0, w.router);
  if (s.ok()) s = load(TensorKind::kRouterBias, 0, w.router_bias);
  w.gate.resize(c.num_experts);
  w.up.resize(c.num_experts);
  w.down.resize(c.num_experts);
  for (int e = 0; s.ok() && e < c.num_experts; ++e) {
    s = load(TensorKind::kExpertGate, e, w.gate[e]);
    if (s.ok()) s = load(TensorKind::kExpertUp, e, w.up[e]);
    if (s.ok()) s = load(TensorKind::kExpertDown, e, w.down[e]);
  }
  if (s.ok()) s = load(TensorKind::kSharedGate, 0, w.shared_gate);
  if (s.ok()) s = load(TensorKind::kSharedUp, 0, w.shared_up);
  if (s.ok()) s = load(TensorKind::kSharedDown, 0, w.shared_down);
  if (s.ok()) s = load(TensorKind::kSharedExpertGate, 0, w.shared_expert_gate);
  if (!s.ok()) return s;
  return w;
}

}  // namespace epserve::model
