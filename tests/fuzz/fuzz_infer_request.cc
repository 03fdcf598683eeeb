// Fuzz target: request validation and tensor decoding. Input: the bytes of a serialized
// ModelInferRequest, as they arrive on the wire.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "grpc_service.pb.h"
#include "server/dtype.h"
#include "server/validation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  inference::ModelInferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  static const epserve::server::ServedModel model{.hidden_size = 8, .layers = {1, 3}};
  static const epserve::server::RequestOptions requests{
      .model_name = "moe", .max_request_tokens = 64, .priority_levels = 3, .default_priority = 2};
  static const epserve::server::ModelSignature signature(model, requests);
  absl::StatusOr<epserve::server::ParsedInfer> parsed =
      epserve::server::ParseInfer(request, signature);
  if (!parsed.ok()) {
    // Every refusal names what was wrong.
    if (parsed.status().message().empty()) __builtin_trap();
    return 0;
  }
  // An accepted request's input decodes in full: exactly T x H elements are readable.
  std::vector<float> rows(static_cast<size_t>(parsed->num_tokens * signature.hidden_size));
  epserve::server::ToFp32(parsed->input_type, parsed->input, rows.data(), rows.size());
  if (parsed->num_tokens < 1 || parsed->num_tokens > signature.max_request_tokens) __builtin_trap();
  return 0;
}
