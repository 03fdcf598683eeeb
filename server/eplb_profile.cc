#include "server/eplb_profile.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/eplb.h"

namespace epserve::server {

absl::StatusOr<std::vector<worker::ExpertPlacement>> PlaceExperts(
    const model::ModelConfig& config, int num_workers, int redundant,
    const model::ExpertLoadProfile* profile, int min_copies) {
  const int experts = config.layer.num_experts;
  if (min_copies < 1 || min_copies > num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--eplb-min-copies must be in [1, workers = ", num_workers, "], got ", min_copies));
  }
  if (redundant < experts * (min_copies - 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--eplb-min-copies=", min_copies, " needs --redundant-experts >= experts x (",
                     min_copies, " - 1) = ", experts * (min_copies - 1), ", got ", redundant));
  }
  if (profile != nullptr && profile->num_experts != experts) {
    return absl::InvalidArgumentError(absl::StrCat("--eplb-profile is of a model with ",
                                                   profile->num_experts,
                                                   " experts; the served one has ", experts));
  }
  std::vector<worker::ExpertPlacement> placements;
  for (int layer : config.moe_layers) {
    if (redundant == 0 && profile == nullptr) {
      EPSERVE_ASSIGN_OR_RETURN(worker::ExpertPlacement p,
                               worker::ExpertPlacement::Contiguous(experts, num_workers));
      placements.push_back(std::move(p));
      continue;
    }
    std::vector<double> load(experts, 1.0);
    if (profile != nullptr) {
      auto it = profile->layers.find(layer);
      if (it != profile->layers.end()) load = it->second;
    }
    EPSERVE_ASSIGN_OR_RETURN(worker::BalancedPlacement b,
                             worker::BalanceExperts(load, num_workers, redundant, min_copies));
    EPSERVE_ASSIGN_OR_RETURN(worker::ExpertPlacement p,
                             worker::ExpertPlacement::FromSlots(experts, b.experts_of));
    placements.push_back(std::move(p));
  }
  return placements;
}

}  // namespace epserve::server
