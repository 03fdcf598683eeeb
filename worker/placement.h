// Which worker owns which experts.
#pragma once

#include <vector>

#include "absl/status/statusor.h"

namespace epserve::worker {

// Contiguous placement: worker w owns experts [first(w), first(w) + count(w)), counts
// differing by at most one when E is not a multiple of W. Immutable, thread-safe.
class ExpertPlacement {
 public:
  // 1 <= num_workers <= num_experts, else INVALID_ARGUMENT.
  static absl::StatusOr<ExpertPlacement> Contiguous(int num_experts, int num_workers);

  int num_experts() const { return static_cast<int>(owner_.size()); }
  int num_workers() const { return static_cast<int>(first_.size()) - 1; }
  int first(int worker) const { return first_[worker]; }
  int count(int worker) const { return first_[worker + 1] - first_[worker]; }
  int owner(int expert) const { return owner_[expert]; }

 private:
  std::vector<int> first_;  // num_workers + 1 entries
  std::vector<int> owner_;  // per expert
};

}  // namespace epserve::worker
