#include "server/validation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace epserve::server {
namespace {

absl::Status Invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }

}  // namespace

absl::StatusOr<ParsedInfer> ParseInfer(const inference::ModelInferRequest& req,
                                       const ModelSignature& sig) {
  if (req.model_name() != sig.name) {
    return absl::NotFoundError(absl::StrCat("unknown model '", req.model_name(),
                                            "'; this server serves '", sig.name, "'"));
  }
  if (!req.model_version().empty() && req.model_version() != "1") {
    return absl::NotFoundError(absl::StrCat("unknown version '", req.model_version(),
                                            "' of model '", sig.name, "'; versions: 1"));
  }
  ParsedInfer out;
  out.layer = sig.layers.front();
  if (auto it = req.parameters().find(kLayerParameter); it != req.parameters().end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kInt64Param) {
      return Invalid("parameter 'layer' must be an int64_param");
    }
    out.layer = it->second.int64_param();
    auto pos = std::find(sig.layers.begin(), sig.layers.end(), out.layer);
    if (pos == sig.layers.end()) {
      return absl::NotFoundError(
          absl::StrCat("parameter 'layer' = ", out.layer,
                       " is not a served MoE layer; served: ", absl::StrJoin(sig.layers, ", ")));
    }
  }
  out.layer_pos = static_cast<int>(std::find(sig.layers.begin(), sig.layers.end(), out.layer) -
                                   sig.layers.begin());

  if (req.inputs_size() == 0) return Invalid("missing input '", kInputName, "'");
  for (const auto& input : req.inputs()) {
    if (input.name() != kInputName) {
      return Invalid("unknown input '", input.name(), "'; expected exactly one input '", kInputName,
                     "'");
    }
  }
  if (req.inputs_size() != 1)
    return Invalid("input '", kInputName, "' given ", req.inputs_size(), " times");
  const auto& input = req.inputs(0);
  if (input.datatype() != "FP32") {
    return Invalid("input '", kInputName, "' datatype must be FP32, got '", input.datatype(), "'");
  }
  if (input.shape_size() != 2) {
    return Invalid("input '", kInputName, "' shape must have rank 2 [tokens, ", sig.hidden_size,
                   "], got rank ", input.shape_size());
  }
  const int64_t tokens = input.shape(0);
  if (tokens < 1 || tokens > sig.max_request_tokens) {
    return Invalid("input '", kInputName, "' shape[0] (tokens) must be in [1, ",
                   sig.max_request_tokens, "], got ", tokens);
  }
  if (input.shape(1) != sig.hidden_size) {
    return Invalid("input '", kInputName, "' shape[1] (hidden size) must be ", sig.hidden_size,
                   ", got ", input.shape(1));
  }
  out.num_tokens = tokens;
  const int64_t elements = tokens * sig.hidden_size;
  const bool has_typed = input.has_contents();
  const bool has_raw = req.raw_input_contents_size() > 0;
  if (has_typed && has_raw) {
    return Invalid("input '", kInputName,
                   "' has both contents and raw_input_contents; use exactly one");
  }
  if (has_raw) {
    if (req.raw_input_contents_size() != 1) {
      return Invalid("raw_input_contents must have one entry per input (1), got ",
                     req.raw_input_contents_size());
    }
    const std::string& raw = req.raw_input_contents(0);
    if (static_cast<int64_t>(raw.size()) != elements * 4) {
      return Invalid("raw_input_contents[0] must hold ", elements * 4, " bytes (", tokens, " x ",
                     sig.hidden_size, " FP32), got ", raw.size());
    }
    out.input = raw.data();
  } else if (has_typed) {
    const auto& fp32 = input.contents().fp32_contents();
    if (fp32.size() != elements) {
      return Invalid("contents.fp32_contents of input '", kInputName, "' must hold ", elements,
                     " values (", tokens, " x ", sig.hidden_size, "), got ", fp32.size());
    }
    out.input = reinterpret_cast<const char*>(fp32.data());
  } else {
    return Invalid("input '", kInputName,
                   "' has no data: set raw_input_contents or contents.fp32_contents");
  }
  for (const auto& output : req.outputs()) {
    if (output.name() != kOutputName) {
      return Invalid("unknown requested output '", output.name(), "'; outputs: ", kOutputName);
    }
  }
  return out;
}

}  // namespace epserve::server
