// How much weight memory a worker rank holds.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "model/moe_config.h"

namespace epserve::model {

// The weights worker `worker` of `num_workers` holds for every served layer (config.moe_layers):
// the router (and its bias), its routed experts and the shared expert (with its gate). Experts
// are placed contiguously the way worker/ places them: worker w owns experts
// common::ContiguousShare(E, w, W). With `shared_split` (--shared-expert=split) a worker holds only its
// slice of the shared expert's intermediate columns (model::SharedExpertSlice).
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

}  // namespace epserve::model
