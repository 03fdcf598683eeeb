#include "worker/eplb.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/share.h"

namespace epserve::worker {
namespace {

double BalancednessOf(const std::vector<double>& worker_load) {
  const double max = *std::max_element(worker_load.begin(), worker_load.end());
  if (max <= 0) return 1.0;
  const double sum = std::accumulate(worker_load.begin(), worker_load.end(), 0.0);
  return sum / worker_load.size() / max;
}

absl::Status CheckArguments(std::span<const double> load, int num_workers, int redundant) {
  const int64_t experts = static_cast<int64_t>(load.size());
  if (num_workers < 1 || num_workers > experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EPLB: num_workers must be in [1, num_experts=", experts, "], got ", num_workers));
  }
  if (redundant < 0 || redundant > experts * (num_workers - 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("EPLB: redundant experts must be in [0, num_experts x (num_workers - 1) = ",
                     experts * (num_workers - 1),
                     "] (a worker holds one copy of an expert at most), got ", redundant));
  }
  for (size_t e = 0; e < load.size(); ++e) {
    if (!std::isfinite(load[e]) || load[e] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("EPLB: load of expert ", e, " must be finite and >= 0, got ", load[e]));
    }
  }
  return absl::OkStatus();
}

// Step 1: copies per expert after giving each redundant copy to the expert with the highest
// load per copy (an expert already on every worker takes no more).
std::vector<int> Replicate(std::span<const double> load, int num_workers, int redundant,
                           int min_copies) {
  std::vector<int> copies(load.size(), min_copies);
  const int left = redundant - static_cast<int>(load.size()) * (min_copies - 1);
  for (int n = 0; n < left; ++n) {
    int best = -1;
    for (size_t e = 0; e < load.size(); ++e) {
      if (copies[e] >= num_workers) continue;
      if (best < 0 || load[e] / copies[e] > load[best] / copies[best]) best = static_cast<int>(e);
    }
    ++copies[best];  // exists: redundant <= E x (W - 1) leaves an expert below W copies
  }
  return copies;
}

// Puts a copy of expert e on worker w.
void Put(BalancedPlacement& p, std::span<const double> load, const std::vector<int>& copies, int e,
         int w) {
  p.experts_of[w].push_back(e);
  p.holders[e].push_back(w);
  p.worker_load[w] += load[e] / copies[e];
}

bool Holds(const BalancedPlacement& p, int w, int e) {
  return std::find(p.experts_of[w].begin(), p.experts_of[w].end(), e) != p.experts_of[w].end();
}

// Whether worker w has a free slot, `total` copies being spread over the workers: each has
// total / W slots, the first total % W one more.
bool HasRoom(const BalancedPlacement& p, int w, int total) {
  const int slots = total / p.num_workers + (w < total % p.num_workers ? 1 : 0);
  return static_cast<int>(p.experts_of[w].size()) < slots;
}

// Where every worker with a free slot (f) already holds expert e: moves a copy of some expert x
// that f does not hold from a worker v that does not hold e over to f, and puts e on v (the
// slot counts stay, and no worker holds an expert twice); false where no such move exists.
bool Swap(BalancedPlacement& p, std::span<const double> load, const std::vector<int>& copies,
          int total, int e) {
  const int workers = p.num_workers;
  for (int f = 0; f < workers; ++f) {
    if (!HasRoom(p, f, total)) continue;
    for (int v = 0; v < workers; ++v) {
      if (v == f || Holds(p, v, e)) continue;
      std::vector<int>& on_v = p.experts_of[v];
      for (size_t i = 0; i < on_v.size(); ++i) {
        const int x = on_v[i];
        if (Holds(p, f, x)) continue;
        on_v.erase(on_v.begin() + static_cast<std::ptrdiff_t>(i));
        p.worker_load[v] -= load[x] / copies[x];
        std::replace(p.holders[x].begin(), p.holders[x].end(), v, f);
        p.experts_of[f].push_back(x);
        p.worker_load[f] += load[x] / copies[x];
        Put(p, load, copies, e, v);
        return true;
      }
    }
  }
  return false;
}

}  // namespace

double BalancedPlacement::Balancedness() const { return BalancednessOf(worker_load); }

double ContiguousBalancedness(std::span<const double> load, int num_workers) {
  const int64_t experts = static_cast<int64_t>(load.size());
  if (num_workers < 1 || num_workers > experts) return 0;
  std::vector<double> worker_load(num_workers, 0.0);
  for (int w = 0; w < num_workers; ++w) {
    const common::Share own = common::ContiguousShare(experts, w, num_workers);
    for (int64_t e = own.begin; e < own.end; ++e) worker_load[w] += load[e];
  }
  return BalancednessOf(worker_load);
}

absl::StatusOr<BalancedPlacement> BalanceExperts(std::span<const double> load, int num_workers,
                                                 int redundant, int min_copies) {
  if (absl::Status s = CheckArguments(load, num_workers, redundant); !s.ok()) return s;
  const int experts = static_cast<int>(load.size());
  if (min_copies < 1 || min_copies > num_workers ||
      redundant < static_cast<int64_t>(experts) * (min_copies - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EPLB: at least ", min_copies, " copies of each expert need 1 <= copies <= workers (",
        num_workers,
        ") and experts x (copies - 1) = ", static_cast<int64_t>(experts) * (min_copies - 1),
        " redundant copies or more, got ", redundant));
  }
  const std::vector<int> copies = Replicate(load, num_workers, redundant, min_copies);

  // Step 2: every copy, heaviest per-copy load first (ties: lower expert id).
  std::vector<int> order;  // one entry per copy: its expert
  for (int e = 0; e < experts; ++e) order.insert(order.end(), copies[e], e);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return load[a] / copies[a] > load[b] / copies[b]; });

  BalancedPlacement p;
  p.num_experts = experts;
  p.num_workers = num_workers;
  p.holders.assign(experts, {});
  p.experts_of.assign(num_workers, {});
  p.worker_load.assign(num_workers, 0.0);
  const int total = experts + redundant;
  for (int e : order) {
    int best = -1;
    for (int w = 0; w < num_workers; ++w) {
      if (!HasRoom(p, w, total) || Holds(p, w, e)) continue;
      if (best < 0 || p.worker_load[w] < p.worker_load[best]) best = w;
    }
    if (best < 0 && !Swap(p, load, copies, total, e)) {
      return absl::InternalError(absl::StrCat("EPLB: no worker can take a copy of expert ", e, " (",
                                              copies[e], " copies, ", num_workers, " workers)"));
    }
    if (best >= 0) Put(p, load, copies, e, best);
  }
  for (std::vector<int>& h : p.holders) std::sort(h.begin(), h.end());
  return p;
}

double PlacementBalancedness(const ExpertPlacement& placement, std::span<const double> load) {
  std::vector<double> worker(placement.num_workers(), 0.0);
  for (int e = 0; e < placement.num_experts() && e < static_cast<int>(load.size()); ++e) {
    const std::span<const ExpertPlacement::Copy> copies = placement.copies(e);
    for (const ExpertPlacement::Copy& c : copies) worker[c.worker] += load[e] / copies.size();
  }
  double total = 0, most = 0;
  for (double w : worker) {
    total += w;
    most = std::max(most, w);
  }
  return most > 0 ? total / worker.size() / most : 1.0;
}

ExpertPlacement KeepInPlace(const ExpertPlacement& next, const ExpertPlacement& current) {
  const int workers = next.num_workers();
  struct Match {
    int overlap, from, to;  // next's worker `from` becomes worker `to`
  };
  std::vector<Match> matches;
  for (int from = 0; from < workers; ++from) {
    for (int to = 0; to < workers; ++to) {
      if (next.count(from) != current.count(to)) continue;
      int overlap = 0;
      for (int e : next.experts(from)) overlap += current.LocalIndex(to, e) >= 0;
      matches.push_back({overlap, from, to});
    }
  }
  std::stable_sort(matches.begin(), matches.end(),
                   [](const Match& a, const Match& b) { return a.overlap > b.overlap; });
  std::vector<int> to_of(workers, -1);
  std::vector<bool> taken(workers, false);
  for (const Match& m : matches) {
    if (to_of[m.from] >= 0 || taken[m.to]) continue;
    to_of[m.from] = m.to;
    taken[m.to] = true;
  }
  std::vector<std::vector<int>> experts_of(workers);
  for (int from = 0; from < workers; ++from) {
    if (to_of[from] < 0) return next;  // slot counts differ: keep the names
    const std::span<const int> e = next.experts(from);
    experts_of[to_of[from]].assign(e.begin(), e.end());
  }
  absl::StatusOr<ExpertPlacement> renamed =
      ExpertPlacement::FromSlots(next.num_experts(), std::move(experts_of));
  return renamed.ok() ? *std::move(renamed) : next;
}

}  // namespace epserve::worker
