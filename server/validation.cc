#include "server/validation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "server/clip.h"

namespace epserve::server {
namespace {

using Parameters = google::protobuf::Map<std::string, inference::InferParameter>;
using RequestedOutput = inference::ModelInferRequest::InferRequestedOutputTensor;

absl::Status Invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }

// An integer request parameter given as int64_param or uint64_param (Triton's clients use
// either); INVALID_ARGUMENT naming it otherwise or when negative.
absl::StatusOr<int64_t> NonNegativeInt(const inference::InferParameter& p, const char* name) {
  int64_t v = 0;
  if (p.parameter_choice_case() == inference::InferParameter::kInt64Param) {
    v = p.int64_param();
  } else if (p.parameter_choice_case() == inference::InferParameter::kUint64Param) {
    if (p.uint64_param() > static_cast<uint64_t>(INT64_MAX)) {
      return Invalid("parameter '", Clip(name), "' must be at most ", INT64_MAX);
    }
    v = static_cast<int64_t>(p.uint64_param());
  } else {
    return Invalid("parameter '", Clip(name), "' must be an int64_param or uint64_param");
  }
  if (v < 0) return Invalid("parameter '", Clip(name), "' must be >= 0, got ", v);
  return v;
}

// The registries a request's shared memory parameters are looked up in (either may be null).
struct Registries {
  const SharedMemoryRegistry* system = nullptr;
  const CudaSharedMemoryRegistry* cuda = nullptr;
};

// The bytes [offset, offset + byte_size) of a registered region that the tensor `what` names
// with Triton's shared-memory parameters; nullopt-like (region null) when it names none.
// `bytes` is what the tensor needs: the size given must equal it (`exact`, inputs) or be at
// least it (outputs).
absl::StatusOr<ShmPlace> SharedMemoryPlace(const Parameters& params, const std::string& what,
                                           int64_t bytes, bool exact, const Registries& shm) {
  auto region = params.find(kShmRegionParameter);
  if (region == params.end()) {
    for (const char* p : {kShmOffsetParameter, kShmByteSizeParameter}) {
      if (params.count(p) > 0) {
        return Invalid(what, ": parameter '", p, "' needs '", kShmRegionParameter, "'");
      }
    }
    return ShmPlace{};
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam) {
    return Invalid(what, ": parameter '", kShmRegionParameter, "' must be a string_param");
  }
  if (shm.system == nullptr) return Invalid(what, ": shared memory is not served here");
  auto size_it = params.find(kShmByteSizeParameter);
  if (size_it == params.end()) {
    return Invalid(what, ": parameter '", kShmByteSizeParameter, "' is missing");
  }
  absl::StatusOr<int64_t> size = NonNegativeInt(size_it->second, kShmByteSizeParameter);
  if (!size.ok()) return size.status();
  int64_t offset = 0;
  if (auto it = params.find(kShmOffsetParameter); it != params.end()) {
    absl::StatusOr<int64_t> o = NonNegativeInt(it->second, kShmOffsetParameter);
    if (!o.ok()) return o.status();
    offset = *o;
  }
  if (exact ? *size != bytes : *size < bytes) {
    return Invalid(what, ": ", kShmByteSizeParameter, " must be ", exact ? "" : "at least ", bytes,
                   ", got ", *size);
  }
  const std::string& name = region->second.string_param();
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> r = shm.system->Find(name);
  if (!r.ok() && absl::IsNotFound(r.status()) && shm.cuda != nullptr) {
    if (absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> c = shm.cuda->Find(name);
        c.ok()) {
      EPSERVE_RETURN_IF_ERROR(
          (*c)->CheckSpan(static_cast<uint64_t>(offset), static_cast<uint64_t>(bytes), what));
      ShmPlace place;
      place.cuda = *std::move(c);
      place.cuda_offset = static_cast<uint64_t>(offset);
      return place;
    }
  }
  if (!r.ok())
    return absl::Status(r.status().code(), absl::StrCat(what, ": ", r.status().message()));
  absl::StatusOr<char*> data =
      (*r)->Span(static_cast<uint64_t>(offset), static_cast<uint64_t>(bytes), what);
  if (!data.ok()) return data.status();
  ShmPlace place;
  place.region = *std::move(r);
  place.data = *data;
  return place;
}

// NOT_FOUND unless the request names the served model, in version "1" or none.
absl::Status CheckModel(const inference::ModelInferRequest& req, const ModelSignature& sig) {
  if (req.model_name() != sig.name) {
    return absl::NotFoundError(absl::StrCat("unknown model '", Clip(req.model_name()),
                                            "'; this server serves '", sig.name, "'"));
  }
  if (!req.model_version().empty() && req.model_version() != "1") {
    return absl::NotFoundError(absl::StrCat("unknown version '", Clip(req.model_version()),
                                            "' of model '", sig.name, "'; versions: 1"));
  }
  return absl::OkStatus();
}

// The request parameters `layer`, `priority` and `timeout` into out->layer, layer_pos,
// priority and timeout; the signature's first layer and default level where absent.
absl::Status ReadParameters(const Parameters& params, const ModelSignature& sig, ParsedInfer* out) {
  out->layer = sig.layers.front();
  out->priority = sig.default_priority;
  if (auto it = params.find(kLayerParameter); it != params.end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kInt64Param) {
      return Invalid("parameter 'layer' must be an int64_param");
    }
    out->layer = it->second.int64_param();
    auto pos = std::find(sig.layers.begin(), sig.layers.end(), out->layer);
    if (pos == sig.layers.end()) {
      return absl::NotFoundError(
          absl::StrCat("parameter 'layer' = ", out->layer,
                       " is not a served MoE layer; served: ", absl::StrJoin(sig.layers, ", ")));
    }
  }
  out->layer_pos = static_cast<int>(std::find(sig.layers.begin(), sig.layers.end(), out->layer) -
                                    sig.layers.begin());
  if (auto it = params.find(kPriorityParameter); it != params.end()) {
    absl::StatusOr<int64_t> p = NonNegativeInt(it->second, kPriorityParameter);
    if (!p.ok()) return p.status();
    if (*p > sig.priority_levels) {
      return Invalid("parameter 'priority' must be in [0, ", sig.priority_levels,
                     "] (0: the default level ", sig.default_priority, "), got ", *p);
    }
    if (*p != 0) out->priority = static_cast<uint32_t>(*p);
  }
  if (auto it = params.find(kTimeoutParameter); it != params.end()) {
    absl::StatusOr<int64_t> us = NonNegativeInt(it->second, kTimeoutParameter);
    if (!us.ok()) return us.status();
    if (*us > 0) out->timeout = absl::Microseconds(*us);
  }
  return absl::OkStatus();
}

// Exactly one input, named hidden_states, of a request datatype and shape [T, H]: sets
// out->input_type, output_type (the input's until an output asks) and num_tokens.
absl::Status ReadInputShape(const inference::ModelInferRequest& req, const ModelSignature& sig,
                            ParsedInfer* out) {
  if (req.inputs_size() == 0) return Invalid("missing input '", kInputName, "'");
  for (const auto& input : req.inputs()) {
    if (input.name() != kInputName) {
      return Invalid("unknown input '", Clip(input.name()), "'; expected exactly one input '",
                     kInputName, "'");
    }
  }
  if (req.inputs_size() != 1)
    return Invalid("input '", kInputName, "' given ", req.inputs_size(), " times");
  const auto& input = req.inputs(0);
  // Clipped first: a datatype past kMaxQuotedBytes is no datatype anyway, and the error quotes
  // it bounded.
  absl::StatusOr<common::ElementType> type = common::ParseKServeName(
      Clip(input.datatype()), absl::StrCat("input '", kInputName, "' datatype"), kRequestTypes);
  if (!type.ok()) return type.status();
  out->input_type = *type;
  out->output_type = *type;
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
  out->num_tokens = tokens;
  return absl::OkStatus();
}

// Sets out->input to the input's num_tokens x H elements, from exactly one of: a shared memory
// region (also out->input_region), raw_input_contents, or contents.fp32_contents (FP32 only);
// each must hold exactly the shape's size. Runs after ReadInputShape.
absl::Status ReadInputContents(const inference::ModelInferRequest& req, const ModelSignature& sig,
                               const Registries& shm, ParsedInfer* out) {
  const auto& input = req.inputs(0);
  const int64_t tokens = out->num_tokens;
  const int64_t elements = tokens * sig.hidden_size;
  const int64_t bytes = elements * static_cast<int64_t>(common::ElementBytes(out->input_type));
  const bool has_typed = input.has_contents();
  const bool has_raw = req.raw_input_contents_size() > 0;
  absl::StatusOr<ShmPlace> in_shm = SharedMemoryPlace(
      input.parameters(), absl::StrCat("input '", kInputName, "'"), bytes, true, shm);
  if (!in_shm.ok()) return in_shm.status();
  if (in_shm->placed()) {
    if (has_typed || has_raw) {
      return Invalid("input '", kInputName,
                     "' is in shared memory and must not also carry contents or "
                     "raw_input_contents");
    }
    out->input = in_shm->data;  // null for a CUDA region (out->input_cuda)
    out->input_region = std::move(in_shm->region);
    if (in_shm->cuda != nullptr) out->input_cuda = *std::move(in_shm);
    return absl::OkStatus();
  }
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
    if (static_cast<int64_t>(raw.size()) != bytes) {
      return Invalid("raw_input_contents[0] must hold ", bytes, " bytes (", tokens, " x ",
                     sig.hidden_size, " ", Clip(input.datatype()), "), got ", raw.size());
    }
    out->input = raw.data();
  } else if (has_typed) {
    if (out->input_type != common::ElementType::kFp32) {
      return Invalid("input '", kInputName, "' of datatype ", Clip(input.datatype()),
                     " must travel in raw_input_contents (contents has no field for it)");
    }
    const auto& fp32 = input.contents().fp32_contents();
    if (fp32.size() != elements) {
      return Invalid("contents.fp32_contents of input '", kInputName, "' must hold ", elements,
                     " values (", tokens, " x ", sig.hidden_size, "), got ", fp32.size());
    }
    out->input = reinterpret_cast<const char*>(fp32.data());
  } else {
    return Invalid("input '", kInputName,
                   "' has no data: set raw_input_contents or contents.fp32_contents");
  }
  return absl::OkStatus();
}

// The requested output topk_ids (`ids`) or topk_weights, of `bytes` bytes: named once, with
// no parameter but its shared memory placement (out->topk_ids_shm or topk_weights_shm).
absl::Status ReadTopkOutput(const RequestedOutput& output, bool ids, int64_t bytes,
                            const Registries& shm, ParsedInfer* out) {
  bool& want = ids ? out->want_topk_ids : out->want_topk_weights;
  if (want) return Invalid("output '", Clip(output.name()), "' requested twice");
  want = true;
  for (const auto& [name, value] : output.parameters()) {
    if (name != kShmRegionParameter && name != kShmOffsetParameter &&
        name != kShmByteSizeParameter) {
      return Invalid("output '", output.name(), "' takes no parameter '", Clip(name),
                     "' (only shared memory placement)");
    }
  }
  absl::StatusOr<ShmPlace> place = SharedMemoryPlace(
      output.parameters(), absl::StrCat("output '", output.name(), "'"), bytes, false, shm);
  if (!place.ok()) return place.status();
  if (place->cuda != nullptr) {
    return Invalid("output '", output.name(),
                   "' cannot go to CUDA shared memory (only moe_output can): place it in "
                   "system shared memory or the response");
  }
  (ids ? out->topk_ids_shm : out->topk_weights_shm) = *std::move(place);
  return absl::OkStatus();
}

// The parameters of the requested output moe_output: `datatype` sets out->output_type,
// `classification` is refused, any other (its shared memory placement among them) is left
// to the caller.
absl::Status ReadOutputParameters(const Parameters& params, ParsedInfer* out) {
  for (const auto& [name, value] : params) {
    if (name == kDatatypeParameter) {
      const absl::string_view datatype =
          value.parameter_choice_case() == inference::InferParameter::kStringParam
              ? absl::string_view(value.string_param())
              : absl::string_view();  // parses as no type
      absl::StatusOr<common::ElementType> want =
          common::ParseKServeName(datatype, "datatype", kRequestTypes);
      if (!want.ok()) {
        return Invalid("parameter 'datatype' of output '", kOutputName, "' must be a string_param ",
                       common::KServeNames(kRequestTypes));
      }
      out->output_type = *want;
    } else if (name == "classification") {
      return Invalid("parameter 'classification' of output '", kOutputName,
                     "' is not supported (the output is not a classification)");
    }
  }
  return absl::OkStatus();
}

// The requested outputs: without any the answer is moe_output; with some, exactly those
// (Triton's rule), each named once, with its datatype and shared memory placement.
absl::Status ReadRequestedOutputs(const inference::ModelInferRequest& req,
                                  const ModelSignature& sig, const Registries& shm,
                                  ParsedInfer* out) {
  if (req.outputs_size() > 0) out->want_output = false;
  for (const auto& output : req.outputs()) {
    const bool ids = output.name() == kTopkIdsName;
    if (ids || output.name() == kTopkWeightsName) {
      EPSERVE_RETURN_IF_ERROR(
          ReadTopkOutput(output, ids, out->num_tokens * sig.top_k * 4, shm, out));
      continue;
    }
    if (output.name() != kOutputName) {
      return Invalid("unknown requested output '", Clip(output.name()), "'; outputs: ", kOutputName,
                     ", ", kTopkIdsName, ", ", kTopkWeightsName);
    }
    if (out->want_output) return Invalid("output '", kOutputName, "' requested twice");
    out->want_output = true;
    EPSERVE_RETURN_IF_ERROR(ReadOutputParameters(output.parameters(), out));
  }
  // The output's size depends on its datatype, known only once every parameter is read.
  for (const auto& output : req.outputs()) {
    if (output.name() != kOutputName) continue;
    absl::StatusOr<ShmPlace> place =
        SharedMemoryPlace(output.parameters(), absl::StrCat("output '", kOutputName, "'"),
                          out->num_tokens * sig.hidden_size *
                              static_cast<int64_t>(common::ElementBytes(out->output_type)),
                          false, shm);
    if (!place.ok()) return place.status();
    out->output_shm = *std::move(place);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ParsedInfer> ParseInfer(const inference::ModelInferRequest& req,
                                       const ModelSignature& sig,
                                       const SharedMemoryRegistry* system_shm,
                                       const CudaSharedMemoryRegistry* cuda_shm) {
  const Registries shm{system_shm, cuda_shm};
  EPSERVE_RETURN_IF_ERROR(CheckModel(req, sig));
  if (req.id().size() > kMaxRequestIdBytes) {
    return Invalid("id is ", req.id().size(), " bytes; at most ", kMaxRequestIdBytes);
  }
  ParsedInfer out;
  EPSERVE_RETURN_IF_ERROR(ReadParameters(req.parameters(), sig, &out));
  EPSERVE_RETURN_IF_ERROR(ReadInputShape(req, sig, &out));
  EPSERVE_RETURN_IF_ERROR(ReadInputContents(req, sig, shm, &out));
  EPSERVE_RETURN_IF_ERROR(ReadRequestedOutputs(req, sig, shm, &out));
  return out;
}

absl::Status RequestOptions::Validate() const {
  if (max_request_tokens < 1) return Invalid("--max-request-tokens must be >= 1");
  if (priority_levels < 1 || priority_levels > 1000) {
    return Invalid("--priority-levels must be in [1, 1000]");
  }
  if (default_priority < 1 || default_priority > priority_levels) {
    return Invalid("--default-priority must be in [1, --priority-levels=", priority_levels, "]");
  }
  return absl::OkStatus();
}

}  // namespace epserve::server
