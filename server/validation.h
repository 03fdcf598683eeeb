// Request validation: turns a ModelInferRequest into rows the batcher can take, or an
// INVALID_ARGUMENT / NOT_FOUND status naming the field and what was expected.
// Thread-safe: plain functions of their arguments.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc_service.pb.h"
#include "server/dtype.h"

namespace epserve::server {

// What the served model accepts.
struct ModelSignature {
  std::string name;                // --model-name
  int64_t hidden_size = 0;         // H
  std::vector<int> layers;         // served layer indices, ascending; the first is the default
  int64_t max_request_tokens = 0;  // T bound of one request
  uint32_t priority_levels = 1;    // request parameter `priority` in [1, priority_levels]
  uint32_t default_priority = 1;   // the level of a request without one (or with 0)
};

inline constexpr char kInputName[] = "hidden_states";
inline constexpr char kOutputName[] = "moe_output";
inline constexpr char kTopkIdsName[] = "topk_ids";
inline constexpr char kTopkWeightsName[] = "topk_weights";
inline constexpr char kLayerParameter[] = "layer";
inline constexpr char kPriorityParameter[] = "priority";
inline constexpr char kTimeoutParameter[] = "timeout";
// Parameter of the requested output `moe_output`: its datatype ("FP32", "BF16", "FP16").
inline constexpr char kDatatypeParameter[] = "datatype";

// A validated request. `input` points into the request (raw or typed contents), so it is
// valid as long as the request is; it holds num_tokens * H little-endian elements of
// `input_type`, maybe unaligned.
struct ParsedInfer {
  int layer_pos = 0;  // index into ModelSignature::layers
  int64_t layer = 0;  // the model's own layer index
  int64_t num_tokens = 0;
  const char* input = nullptr;
  ElementType input_type = ElementType::kFp32;
  ElementType output_type = ElementType::kFp32;       // the input's unless the request asks
  uint32_t priority = 1;                              // 1 is served first
  absl::Duration timeout = absl::InfiniteDuration();  // request parameter `timeout`
  // Outputs to answer: moe_output unless the request names others; topk_ids (INT32 [T, k])
  // and topk_weights (FP32 [T, k]) when named.
  bool want_output = true;
  bool want_topk_ids = false;
  bool want_topk_weights = false;
};

// Checks, in order: model name and version (NOT_FOUND), the `layer`, `priority` and
// `timeout` parameters, exactly one input named hidden_states, datatype FP32, BF16 or FP16,
// shape [T, H] with 1 <= T <= max_request_tokens, contents (raw, or fp32_contents for FP32;
// not both; sizes matching the shape), requested outputs and their datatype.
absl::StatusOr<ParsedInfer> ParseInfer(const inference::ModelInferRequest& request,
                                       const ModelSignature& signature);

}  // namespace epserve::server
