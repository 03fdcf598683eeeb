// The expert load balancing policy (EPLB): from per-expert loads (tokens routed to each expert
// over a window), which experts get redundant copies and which worker holds each copy, so that
// every worker carries about the same load. It follows the global policy of DeepSeek's
// Expert Parallelism Load Balancer (DeepSeek-V3 technical report, arXiv:2412.19437, section
// 3.4, "redundant experts"; the EPLB repository's rebalance_experts without node groups):
//   1. replicate: start from one copy per expert (or a given minimum); give each of the
//      redundant copies left in turn to the expert whose load per copy is highest (ties: the
//      lower expert id);
//   2. pack: take the copies in descending load per copy (a copy carries load / copies of its
//      expert) and put each on the least loaded worker that still has a free slot and holds no
//      copy of that expert yet (ties: the lower worker id).
// Worker w has Slots(w) = (E + N) / W slots, the first (E + N) % W workers one more, so slot
// counts differ by at most one as in the contiguous placement. A worker never holds two copies
// of one expert, so an expert gets at most W copies.
//
// Pure and deterministic (same loads, same placement); thread-compatible. The serving path
// reads its result as an ExpertPlacement (worker/placement.h; ExpertPlacement::FromSlots of
// experts_of): at start (server/eplb_profile.h) and at each rebalance (server/front_end.h).
#pragma once

#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/placement.h"

namespace epserve::worker {

struct BalancedPlacement {
  int num_experts = 0;
  int num_workers = 0;
  // Per expert, the workers holding a copy (ascending); at least one each.
  std::vector<std::vector<int>> holders;
  // Per worker, the experts it holds, in the order their copies were packed there.
  std::vector<std::vector<int>> experts_of;
  // Per worker, the load its copies carry (each copy of expert e carries load[e] / copies).
  std::vector<double> worker_load;

  // Mean worker load / max worker load: 1 is perfect balance (1 as well when all loads are 0).
  double Balancedness() const;
};

// The balancedness of the contiguous placement (worker w owns experts [E*w/W, E*(w+1)/W)) for
// the same loads, for comparison.
double ContiguousBalancedness(std::span<const double> load, int num_workers);

// Mean worker load / max worker load of `placement` under `load` (one value per expert; each
// copy of an expert carries load / copies, as ChooseCopies spreads it): 1 is even.
double PlacementBalancedness(const ExpertPlacement& placement, std::span<const double> load);

// `next` with its workers renamed so that as many experts as possible stay where `current`
// has them (a worker's set of experts goes to the worker of the same slot count that holds
// most of them, greedily, the largest overlaps first): the same balance, fewer copies to
// load. Both over the same experts and workers.
ExpertPlacement KeepInPlace(const ExpertPlacement& next, const ExpertPlacement& current);

// `load`: one non-negative, finite value per expert. 1 <= num_workers <= load.size(),
// 0 <= redundant <= load.size() * (num_workers - 1); else INVALID_ARGUMENT naming the bound.
// `min_copies` (1 <= min_copies <= num_workers, and redundant >= E x (min_copies - 1)): copies
// every expert gets before step 1 hands out the rest by load (2: any one worker's death leaves
// a copy of every expert on the others).
absl::StatusOr<BalancedPlacement> BalanceExperts(std::span<const double> load, int num_workers,
                                                 int redundant, int min_copies = 1);

}  // namespace epserve::worker
