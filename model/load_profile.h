// A saved expert load profile: per served layer, the load of each expert (pairs routed to it
// since the server started, or any non-negative weights), as epserve's server reports it
// (GET /eplb/profile on the metrics port) and --eplb-profile reads it back. JSON:
//   {"num_experts": E, "layers": {"<layer id>": [load of expert 0, ...], ...}}
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epserve::model {

struct ExpertLoadProfile {
  int num_experts = 0;
  std::map<int, std::vector<double>> layers;  // layer id -> load per expert
};

// INVALID_ARGUMENT naming the member (and the layer) that is wrong.
absl::StatusOr<ExpertLoadProfile> ParseExpertLoadProfile(absl::string_view json);
std::string ExpertLoadProfileJson(const ExpertLoadProfile& profile);
// Reads and parses `path`; errors name the file as --eplb-profile.
absl::StatusOr<ExpertLoadProfile> ReadExpertLoadProfile(const std::string& path);

}  // namespace epserve::model
