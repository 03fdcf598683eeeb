// The placement of every served layer that --redundant-experts and a saved load profile
// (--eplb-profile, model/load_profile.h) give: worker/eplb.h's policy, every rank computing the
// same placements from the same inputs.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "model/load_profile.h"
#include "model/moe_config.h"
#include "worker/placement.h"

namespace epserve::server {

// The placement of each served layer (config.moe_layers, in order) over `num_workers` workers
// with `redundant` redundant copies per layer: with redundant == 0 and no profile the
// contiguous placement; else the balancing policy (worker::BalanceExperts) on the profile's
// loads of that layer (uniform where the profile lacks the layer or there is none).
// Every expert gets at least `min_copies` copies (--eplb-min-copies). INVALID_ARGUMENT naming
// the flag where the profile's expert count is not the model's, or min_copies is outside
// [1, num_workers] or needs more redundant copies than `redundant`.
absl::StatusOr<std::vector<worker::ExpertPlacement>> PlaceExperts(
    const model::ModelConfig& config, int num_workers, int redundant,
    const model::ExpertLoadProfile* profile, int min_copies = 1);

}  // namespace epserve::server
