#include "model/moe_config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace epserve::model {

absl::string_view RoutingKindName(RoutingKind kind) {
  switch (kind) {
    case RoutingKind::kSoftmaxTopK:
      return "softmax_topk";
    case RoutingKind::kSigmoidGroupedTopK:
      return "sigmoid_grouped_topk";
    case RoutingKind::kTopKSoftmax:
      return "topk_softmax";
  }
  return "unknown";
}

absl::Status MoeLayerConfig::Validate() const {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (hidden_size < 1) return bad("hidden_size must be >= 1, got ", hidden_size);
  if (expert_ffn_size < 1) return bad("expert_ffn_size must be >= 1, got ", expert_ffn_size);
  if (num_experts < 1) return bad("num_experts must be >= 1, got ", num_experts);
  if (top_k < 1 || top_k > num_experts)
    return bad("top_k must be in [1, num_experts=", num_experts, "], got ", top_k);
  if (shared_ffn_size < 0) return bad("shared_ffn_size must be >= 0, got ", shared_ffn_size);
  if (shared_expert_gate && shared_ffn_size == 0)
    return bad("shared_expert_gate needs shared_ffn_size > 0");
  const bool sigmoid = routing == RoutingKind::kSigmoidGroupedTopK;
  if (routing == RoutingKind::kTopKSoftmax && n_group != 1)
    return bad("n_group must be 1 with topk_softmax routing, got ", n_group);
  if (sigmoid || n_group != 1) {
    if (n_group < 1 || num_experts % n_group != 0)
      return bad("n_group must divide num_experts=", num_experts, ", got ", n_group);
    if (topk_group < 1 || topk_group > n_group)
      return bad("topk_group must be in [1, n_group=", n_group, "], got ", topk_group);
    if (num_experts / n_group < 2) return bad("each expert group needs at least 2 experts");
    if (top_k > topk_group * (num_experts / n_group))
      return bad("top_k=", top_k, " exceeds the experts of topk_group=", topk_group, " groups");
  }
  return absl::OkStatus();
}

absl::Status CheckSameShape(const ModelConfig& serving, const ModelConfig& next) {
  const MoeLayerConfig& a = serving.layer;
  const MoeLayerConfig& b = next.layer;
  auto differ = [&](absl::string_view field, const auto& now, const auto& then) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, " of '", next.source.substr(0, 128), "' is ", then,
                     " but the running service serves ", now,
                     "; only weights of the same shape "
                     "can replace the served ones (restart the job for another shape)"));
  };
  if (a.hidden_size != b.hidden_size) return differ("hidden_size", a.hidden_size, b.hidden_size);
  if (a.expert_ffn_size != b.expert_ffn_size) {
    return differ("expert_ffn_size", a.expert_ffn_size, b.expert_ffn_size);
  }
  if (a.num_experts != b.num_experts) return differ("num_experts", a.num_experts, b.num_experts);
  if (a.top_k != b.top_k) return differ("top_k", a.top_k, b.top_k);
  if (a.routing != b.routing) {
    return differ("the routing", RoutingKindName(a.routing), RoutingKindName(b.routing));
  }
  if (a.norm_topk_prob != b.norm_topk_prob) {
    return differ("norm_topk_prob", a.norm_topk_prob ? "true" : "false",
                  b.norm_topk_prob ? "true" : "false");
  }
  if (a.n_group != b.n_group) return differ("n_group", a.n_group, b.n_group);
  if (a.topk_group != b.topk_group) return differ("topk_group", a.topk_group, b.topk_group);
  if (a.routed_scaling_factor != b.routed_scaling_factor) {
    return differ("routed_scaling_factor", a.routed_scaling_factor, b.routed_scaling_factor);
  }
  if (a.shared_ffn_size != b.shared_ffn_size) {
    return differ("shared_ffn_size", a.shared_ffn_size, b.shared_ffn_size);
  }
  if (a.shared_expert_gate != b.shared_expert_gate) {
    return differ("shared_expert_gate", a.shared_expert_gate ? "true" : "false",
                  b.shared_expert_gate ? "true" : "false");
  }
  if (serving.moe_layers != next.moe_layers) {
    return differ("the served MoE layers", absl::StrJoin(serving.moe_layers, ","),
                  absl::StrJoin(next.moe_layers, ","));
  }
  return absl::OkStatus();
}

}  // namespace epserve::model
