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
#include "server/cuda_shared_memory.h"
#include "server/dtype.h"
#include "server/served_model.h"
#include "server/shared_memory.h"

namespace epserve::server {

// What a request may be, each setting bound to its flag. FrontEndOptions::requests is its home;
// ParseInfer and the service read it through a ModelSignature, the batcher's queues follow
// priority_levels.
struct RequestOptions {
  std::string model_name = "moe";     // --model-name: the name requests give
  int64_t max_request_tokens = 8192;  // --max-request-tokens: T bound of one request
  int64_t priority_levels = 3;   // --priority-levels: request parameter `priority` in [1, this]
  int64_t default_priority = 2;  // --default-priority: of a request without one (or with 0)

  // INVALID_ARGUMENT naming the flag and its bound.
  absl::Status Validate() const;
};

// What the served model accepts: a view of the model's facts and the request settings, whose
// owners outlive it (no copies: each member refers to its one home).
struct ModelSignature {
  ModelSignature(const ServedModel& model, const RequestOptions& requests)
      : name(requests.model_name),
        hidden_size(model.hidden_size),
        layers(model.layers),
        max_request_tokens(requests.max_request_tokens),
        priority_levels(requests.priority_levels),
        default_priority(requests.default_priority),
        top_k(model.top_k) {}

  const std::string& name;            // --model-name
  const int64_t& hidden_size;         // H
  const std::vector<int>& layers;     // served layer indices, ascending; the first: default
  const int64_t& max_request_tokens;  // T bound of one request
  const int64_t& priority_levels;     // request parameter `priority` in [1, priority_levels]
  const int64_t& default_priority;    // the level of a request without one (or with 0)
  const int& top_k;                   // width of the topk_ids and topk_weights outputs
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
// The request id is echoed in the answer (and in each streamed answer): at most this long.
inline constexpr size_t kMaxRequestIdBytes = 4096;

// Triton's shared-memory parameters of an input or a requested output.
inline constexpr char kShmRegionParameter[] = "shared_memory_region";
inline constexpr char kShmOffsetParameter[] = "shared_memory_offset";
inline constexpr char kShmByteSizeParameter[] = "shared_memory_byte_size";

// Where an output goes when the request placed it in a shared memory region: `data` is
// inside `region`, which the holder keeps mapped.
struct ShmPlace {
  std::shared_ptr<const SharedMemoryRegion> region;
  char* data = nullptr;
  // Or a CUDA region (server/cuda_shared_memory.h), at byte cuda_offset: no host address.
  std::shared_ptr<const CudaSharedMemoryRegion> cuda;
  uint64_t cuda_offset = 0;

  bool placed() const { return region != nullptr || cuda != nullptr; }
};

// A validated request. `input` points into the request (raw or typed contents) or into a
// shared memory region (input_region, kept mapped while held), so it is valid as long as
// both are; it holds num_tokens * H little-endian elements of `input_type`, maybe unaligned.
struct ParsedInfer {
  int layer_pos = 0;  // index into ModelSignature::layers
  int64_t layer = 0;  // the model's own layer index
  int64_t num_tokens = 0;
  const char* input = nullptr;
  common::ElementType input_type = common::ElementType::kFp32;
  common::ElementType output_type =
      common::ElementType::kFp32;                     // the input's unless the request asks
  uint32_t priority = 1;                              // 1 is served first
  absl::Duration timeout = absl::InfiniteDuration();  // request parameter `timeout`
  // Outputs to answer: moe_output unless the request names others; topk_ids (INT32 [T, k])
  // and topk_weights (FP32 [T, k]) when named.
  bool want_output = true;
  bool want_topk_ids = false;
  bool want_topk_weights = false;
  std::shared_ptr<const SharedMemoryRegion> input_region;  // set when the input is in one
  ShmPlace input_cuda;  // cuda set when the input is in CUDA shared memory (input null)
  // Set (placed()) for each output the request placed in shared memory.
  ShmPlace output_shm, topk_ids_shm, topk_weights_shm;
};

// Checks, in order: model name and version (NOT_FOUND), the `layer`, `priority` and
// `timeout` parameters, exactly one input named hidden_states, datatype FP32, BF16 or FP16,
// shape [T, H] with 1 <= T <= max_request_tokens, contents (raw, or fp32_contents for FP32;
// not both; sizes matching the shape; or a shared memory region, offset and size, looked up
// in `shm`, which may be null: no shared memory, then in `cuda_shm` where it is not null),
// requested outputs, their datatype and shared memory placement (topk outputs not in CUDA
// shared memory).
absl::StatusOr<ParsedInfer> ParseInfer(const inference::ModelInferRequest& request,
                                       const ModelSignature& signature,
                                       const SharedMemoryRegistry* shm = nullptr,
                                       const CudaSharedMemoryRegistry* cuda_shm = nullptr);

}  // namespace epserve::server
