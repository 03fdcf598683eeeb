#include "model/moe_config.h"

#include "absl/strings/str_cat.h"
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
  if (routing == RoutingKind::kSigmoidGroupedTopK) {
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

}  // namespace epserve::model
