// Static expert placement from a saved load profile: the per-layer expert loads the server
// reports (GET /eplb/profile on the metrics port: pairs routed to each expert since start),
// read back by --eplb-profile, and the placement of every served layer that
// --redundant-experts and such a profile give (worker/eplb.h's policy, every rank computing
// the same one from the same inputs).
//
// The profile is JSON: {"num_experts": E, "layers": {"<layer id>": [load of expert 0, ...],
// ...}}; loads are non-negative numbers (token counts, or any weights).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/moe_config.h"
#include "worker/placement.h"

namespace epserve::server {

struct ExpertLoadProfile {
  int num_experts = 0;
  std::map<int, std::vector<double>> layers;  // layer id -> load per expert
};

// INVALID_ARGUMENT naming the member (and the layer) that is wrong.
absl::StatusOr<ExpertLoadProfile> ParseExpertLoadProfile(absl::string_view json);
std::string ExpertLoadProfileJson(const ExpertLoadProfile& profile);
// Reads and parses `path`; errors name the file.
absl::StatusOr<ExpertLoadProfile> ReadExpertLoadProfile(const std::string& path);

// The placement of each served layer (config.moe_layers, in order) over `num_workers` workers
// with `redundant` redundant copies per layer: with redundant == 0 and no profile the
// contiguous placement; else the balancing policy (worker::BalanceExperts) on the profile's
// loads of that layer (uniform where the profile lacks the layer or there is none).
// INVALID_ARGUMENT where the profile's expert count is not the model's.
absl::StatusOr<std::vector<worker::ExpertPlacement>> PlaceExperts(const model::ModelConfig& config,
                                                                  int num_workers, int redundant,
                                                                  const ExpertLoadProfile* profile);

}  // namespace epserve::server
