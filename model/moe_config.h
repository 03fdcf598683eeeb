// The description of a served MoE layer, independent of where its weights come from.
#pragma once

#include <cstdint>
#include <string>

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epserve::model {

// How router logits become the k experts of a token and their weights.
enum class RoutingKind {
  // softmax over all experts, top-k of the probabilities, optionally renormalised
  // (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2). With n_group > 1, the top-k is taken among the
  // experts of the topk_group groups whose best probability is largest (DeepSeek-V2's
  // group_limited_greedy).
  kSoftmaxTopK,
  // sigmoid scores; choice on scores + per-expert bias with grouped top-k; weights from
  // the unbiased scores, optionally renormalised, times routed_scaling_factor (DeepSeek-V3).
  kSigmoidGroupedTopK,
  // top-k of the raw logits, then softmax over the k chosen (gpt-oss).
  kTopKSoftmax,
};

absl::string_view RoutingKindName(RoutingKind kind);

// Shape and routing settings of one MoE layer. Every MoE layer of a model shares them.
struct MoeLayerConfig {
  int64_t hidden_size = 0;      // H: width of a token row
  int64_t expert_ffn_size = 0;  // F: intermediate size of one routed expert
  int num_experts = 0;          // E: routed experts
  int top_k = 0;                // k: routed experts per token
  RoutingKind routing = RoutingKind::kSoftmaxTopK;
  bool norm_topk_prob = false;  // renormalise the k weights to sum to 1
  int n_group = 1;              // expert groups (kSigmoidGroupedTopK; kSoftmaxTopK when > 1)
  int topk_group = 1;           // groups a token may choose from (where n_group applies)
  float routed_scaling_factor = 1.0f;
  // Shared experts, fused into one FFN of this intermediate size; 0 means none.
  int64_t shared_ffn_size = 0;
  // The shared output is multiplied by sigmoid(x . shared_gate) (Qwen2-MoE).
  bool shared_expert_gate = false;

  absl::Status Validate() const;
};

// A served model: a name, the MoE layers it serves (the model's own layer indices) and
// their common shape.
struct ModelConfig {
  std::string source;           // what --model said, e.g. "synthetic:tiny" or a folder
  std::string architecture;     // e.g. "qwen1.5-moe-a2.7b", or a checkpoint's model_type
  std::vector<int> moe_layers;  // served layer indices, ascending; never a dense layer
  MoeLayerConfig layer;
  // Decoder layers of the whole model (MoE and dense, num_hidden_layers); every index in
  // moe_layers is below it. Layers in [0, num_layers) not in moe_layers are dense or not
  // served.
  int num_layers = 0;
};

// OK when `next` can replace `serving` in a running service: the same served layers and the
// same layer shape and routing (only the weights differ); else FAILED_PRECONDITION naming
// the first field that differs, with both values.
absl::Status CheckSameShape(const ModelConfig& serving, const ModelConfig& next);

}  // namespace epserve::model
