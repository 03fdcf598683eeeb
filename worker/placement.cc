#include "worker/placement.h"

#include "absl/strings/str_cat.h"

namespace epserve::worker {

absl::StatusOr<ExpertPlacement> ExpertPlacement::Contiguous(int num_experts, int num_workers) {
  if (num_workers < 1 || num_workers > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker count must be in [1, num_experts=", num_experts, "], got ",
                     num_workers, " (launch with mpirun -np 1+W, W <= ", num_experts, ")"));
  }
  ExpertPlacement p;
  p.first_.resize(num_workers + 1);
  p.owner_.resize(num_experts);
  for (int w = 0; w <= num_workers; ++w) {
    p.first_[w] = static_cast<int>(static_cast<long long>(w) * num_experts / num_workers);
  }
  for (int w = 0; w < num_workers; ++w) {
    for (int e = p.first_[w]; e < p.first_[w + 1]; ++e) p.owner_[e] = w;
  }
  return p;
}

}  // namespace epserve::worker
