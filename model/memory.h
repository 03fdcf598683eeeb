// How much weight memory a worker rank holds.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "common/element_type.h"
#include "model/moe_config.h"

namespace epserve::model {

// The weights worker `worker` of `num_workers` holds for every served layer (config.moe_layers):
// the router (and its bias), its routed experts and the shared expert (with its gate). Experts
// are placed contiguously the way worker/ places them: worker w owns experts
// common::ContiguousShare(E, w, W). With `shared_split` (--shared-expert=split) a worker holds only
// its slice of the shared expert's intermediate columns (model::SharedExpertSlice).
struct RankMemory {
  int first_expert = 0;
  int num_experts = 0;        // routed experts owned, per layer
  int num_layers = 0;         // served layers
  int64_t router_params = 0;  // elements, summed over the served layers
  int64_t expert_params = 0;
  int64_t shared_params = 0;
  int64_t params() const { return router_params + expert_params + shared_params; }
  int64_t fp32_bytes() const { return params() * 4; }
  int64_t bf16_bytes() const { return params() * 2; }
};

// INVALID_ARGUMENT unless 1 <= num_workers <= num_experts and 0 <= worker < num_workers.
// With `redundant` > 0 copies per layer beyond one per expert, a worker holds its share of
// the E + redundant slots (the first (E + redundant) % W workers one more; worker/eplb.h),
// which experts being the placement's choice (first_expert is then -1).
absl::StatusOr<RankMemory> EstimateRankBytes(const ModelConfig& config, int num_workers, int worker,
                                             bool shared_split = false, int redundant = 0);

// "1.50 GiB", "12.0 MiB", "512 B": for logs and tools.
std::string FormatBytes(int64_t bytes);

// The admission check of a host, before anything is loaded: what its ranks need, each worker
// rank's weights (EstimateRankBytes; with BF16 weights the router stays FP32, 2 more bytes a
// router parameter) plus one heap segment of `heap_bytes` per rank, the front-end's included,
// against `limit_bytes` (0: this machine's memory, MachineMemoryBytes). RESOURCE_EXHAUSTED
// naming each part and the ways out (--memory-limit's words) when they need more.
struct HostRank {
  int rank = 0;
  int worker = -1;  // -1: the front-end, which holds no expert weights
};
struct HostMemoryCheck {
  const ModelConfig* config = nullptr;
  int num_workers = 1;
  int redundant = 0;          // --redundant-experts
  bool shared_split = false;  // --shared-expert=split
  common::ElementType weight_dtype = common::ElementType::kFp32;
  int64_t heap_bytes = 0;  // one rank's segment
  int64_t limit_bytes = 0;
};
absl::Status CheckHostMemory(const HostMemoryCheck& check, std::span<const HostRank> ranks);

// MemTotal of /proc/meminfo; FAILED_PRECONDITION where it cannot be read.
absl::StatusOr<int64_t> MachineMemoryBytes();

}  // namespace epserve::model
