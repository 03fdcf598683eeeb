// Which worker owns which experts, which rank is which worker, and how a batch's rows are
// split over the workers: the placement every part reads.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace epserve::worker {

// Which rank is which: in a serving job (mpirun -np 1+W) rank 0 is the front-end and worker
// w is rank kFirstWorkerRank + w. The one place that mapping is written.
inline constexpr int kFirstWorkerRank = 1;
constexpr int RankOfWorker(int worker) { return kFirstWorkerRank + worker; }
constexpr int WorkerOfRank(int rank) { return rank - kFirstWorkerRank; }
// Workers in a job of `num_ranks` ranks (the front-end is not one).
constexpr int NumWorkers(int num_ranks) { return num_ranks - kFirstWorkerRank; }

// How a batch's rows are split over the workers: worker w takes rows
// [RowSplit(total, w, W), RowSplit(total, w + 1, W)), sizes differing by at most one.
constexpr int64_t RowSplit(int64_t total_rows, int worker, int num_workers) {
  return total_rows * worker / num_workers;
}

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
