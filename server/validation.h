// Request validation: turns a ModelInferRequest into rows the batcher can take, or an
// INVALID_ARGUMENT / NOT_FOUND status naming the field and what was expected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpc_service.pb.h"

namespace epserve::server {

// What the served model accepts.
struct ModelSignature {
  std::string name;                // --model-name
  int64_t hidden_size = 0;         // H
  std::vector<int> layers;         // served layer indices, ascending; the first is the default
  int64_t max_request_tokens = 0;  // T bound of one request
};

inline constexpr char kInputName[] = "hidden_states";
inline constexpr char kOutputName[] = "moe_output";
inline constexpr char kLayerParameter[] = "layer";

// A validated request. `input` points into the request (raw or typed contents), so it is
// valid as long as the request is; it holds num_tokens * H little-endian floats, maybe
// unaligned (read it with memcpy).
struct ParsedInfer {
  int layer_pos = 0;  // index into ModelSignature::layers
  int64_t layer = 0;  // the model's own layer index
  int64_t num_tokens = 0;
  const char* input = nullptr;
};

// Checks, in order: model name and version (NOT_FOUND), the `layer` parameter, exactly one
// input named hidden_states, datatype FP32, shape [T, H] with 1 <= T <= max_request_tokens,
// contents (raw or fp32_contents, not both, sizes matching the shape), requested outputs.
absl::StatusOr<ParsedInfer> ParseInfer(const inference::ModelInferRequest& request,
                                       const ModelSignature& signature);

}  // namespace epserve::server
