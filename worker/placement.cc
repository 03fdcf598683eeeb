#include "worker/placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/share.h"

namespace epserve::worker {

absl::Status CheckWorkerCount(int num_workers, int num_experts) {
  if (num_workers < 1) {
    return absl::InvalidArgumentError(
        "epserve needs at least 2 ranks (rank 0 front-end + workers): "
        "mpirun -np 1+W epserve ...");
  }
  if (num_workers > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(num_workers, " workers but the model has only ", num_experts,
                     " experts: launch with mpirun -np <= ", num_experts + 1));
  }
  return absl::OkStatus();
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::Contiguous(int num_experts, int num_workers) {
  if (num_workers < 1 || num_workers > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker count must be in [1, num_experts=", num_experts, "], got ",
                     num_workers, " (launch with mpirun -np 1+W, W <= ", num_experts, ")"));
  }
  std::vector<std::vector<int>> experts_of(num_workers);
  for (int w = 0; w < num_workers; ++w) {
    const common::Share own = common::ContiguousShare(num_experts, w, num_workers);
    for (int64_t e = own.begin; e < own.end; ++e) experts_of[w].push_back(static_cast<int>(e));
  }
  return FromSlots(num_experts, std::move(experts_of));
}

std::string WorkerSet::List(int num_workers) const {
  std::string out;
  for (int w = 0; w < num_workers; ++w) {
    if (Has(w)) absl::StrAppend(&out, out.empty() ? "" : ", ", w);
  }
  return out;
}

int64_t RowSplit(int64_t total_rows, int worker, int num_workers, const WorkerSet& live) {
  int before = 0;  // live workers before `worker`
  for (int w = 0; w < worker && w < num_workers; ++w) before += live.Has(w) ? 1 : 0;
  const int count = live.Count();
  return count == 0 ? 0 : common::ShareBegin(total_rows, before, count);
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::FromSlots(int num_experts,
                                                           std::vector<std::vector<int>> experts_of,
                                                           bool idle_workers) {
  if (experts_of.empty() || num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a placement needs at least one worker and one expert, got ",
                     experts_of.size(), " and ", num_experts));
  }
  ExpertPlacement p;
  p.copies_.resize(num_experts);
  for (int w = 0; w < static_cast<int>(experts_of.size()); ++w) {
    if (experts_of[w].empty() && !idle_workers) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", w, " holds no expert"));
    }
    for (int local = 0; local < static_cast<int>(experts_of[w].size()); ++local) {
      const int e = experts_of[w][local];
      if (e < 0 || e >= num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker ", w, " holds expert ", e, ", outside [0, ", num_experts, ")"));
      }
      if (!p.copies_[e].empty() && p.copies_[e].back().worker == w) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker ", w, " holds expert ", e, " twice"));
      }
      p.copies_[e].push_back({w, local});
    }
    p.max_local_ = std::max(p.max_local_, static_cast<int>(experts_of[w].size()));
  }
  for (int e = 0; e < num_experts; ++e) {
    if (p.copies_[e].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", e, " has no copy on any worker"));
    }
  }
  p.experts_of_ = std::move(experts_of);
  return p;
}

absl::StatusOr<ExpertPlacement> ExpertPlacement::OnlyOn(const WorkerSet& live) const {
  std::vector<std::vector<int>> experts_of(num_workers());
  for (int w = 0; w < num_workers(); ++w) {
    if (live.Has(w)) experts_of[w] = experts_of_[w];
  }
  for (int e = 0; e < num_experts(); ++e) {
    bool held = false;
    for (const Copy& c : copies_[e]) held = held || live.Has(c.worker);
    if (!held) {
      return absl::FailedPreconditionError(absl::StrCat(
          "expert ", e, " has no copy on a live worker (its copies were on worker",
          copies_[e].size() > 1 ? "s " : " ",
          absl::StrJoin(copies_[e], ", ",
                        [](std::string* out, const Copy& c) { absl::StrAppend(out, c.worker); }),
          ")"));
    }
  }
  return FromSlots(num_experts(), std::move(experts_of), /*idle_workers=*/true);
}

int ExpertPlacement::LocalIndex(int worker, int expert) const {
  for (const Copy& c : copies_[expert]) {
    if (c.worker == worker) return c.local;
  }
  return -1;
}

int ExpertPlacement::redundant() const {
  int copies = 0;
  for (const std::vector<Copy>& c : copies_) copies += static_cast<int>(c.size());
  return copies - num_experts();
}

std::string ExpertPlacement::Describe() const {
  std::vector<std::string> workers;
  for (int w = 0; w < num_workers(); ++w) {
    std::vector<int> ids = experts_of_[w];
    std::sort(ids.begin(), ids.end());
    std::vector<std::string> runs;
    for (size_t i = 0; i < ids.size();) {
      size_t j = i;
      while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
      runs.push_back(j == i ? absl::StrCat(ids[i]) : absl::StrCat(ids[i], "-", ids[j]));
      i = j + 1;
    }
    workers.push_back(absl::StrCat("w", w, ": ", absl::StrJoin(runs, " ")));
  }
  return absl::StrJoin(workers, ", ");
}

std::vector<int32_t> EncodePlacements(std::span<const ExpertPlacement> placements) {
  std::vector<int32_t> words = {static_cast<int32_t>(placements.size()),
                                placements.empty() ? 0 : placements[0].num_workers()};
  for (const ExpertPlacement& p : placements) {
    for (int w = 0; w < p.num_workers(); ++w) {
      words.push_back(p.count(w));
      for (int e : p.experts(w)) words.push_back(e);
    }
  }
  return words;
}

absl::StatusOr<std::vector<ExpertPlacement>> DecodePlacements(std::span<const int32_t> words,
                                                              int num_experts, int num_workers) {
  size_t at = 0;
  auto next = [&](int32_t& v) {
    if (at >= words.size()) return false;
    v = words[at++];
    return true;
  };
  int32_t layers = 0, workers = 0;
  if (!next(layers) || !next(workers) || layers < 0 || workers != num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("a placement table for ", num_workers,
                                                   " workers must start with its layer "
                                                   "count and ",
                                                   num_workers, "; got ", layers, ", ", workers));
  }
  std::vector<ExpertPlacement> out;
  for (int l = 0; l < layers; ++l) {
    std::vector<std::vector<int>> experts_of(num_workers);
    for (int w = 0; w < num_workers; ++w) {
      int32_t count = 0;
      if (!next(count) || count < 0 || count > num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("placement table: layer ", l, " worker ", w, ": bad or missing count"));
      }
      for (int32_t i = 0, e = 0; i < count; ++i) {
        if (!next(e)) {
          return absl::InvalidArgumentError(
              absl::StrCat("placement table: layer ", l, " worker ", w, ": ends early"));
        }
        experts_of[w].push_back(e);
      }
    }
    // A rebalance over the survivors of a worker's death leaves that worker idle.
    absl::StatusOr<ExpertPlacement> p =
        ExpertPlacement::FromSlots(num_experts, experts_of, /*idle_workers=*/true);
    if (!p.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement table: layer ", l, ": ", p.status().message()));
    }
    out.push_back(*std::move(p));
  }
  if (at != words.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement table: ", words.size() - at, " words past its end"));
  }
  return out;
}

void ChooseCopies(const ExpertPlacement& placement, const int32_t* ids, int64_t n, int k,
                  int sender, int32_t* dest, int32_t* local) {
  const int num_workers = placement.num_workers();
  std::vector<int64_t> given(num_workers, 0);  // this sender's pairs per worker so far
  for (int64_t t = 0; t < n; ++t) {
    for (int j = 0; j < k; ++j) {
      const std::span<const ExpertPlacement::Copy> copies = placement.copies(ids[t * k + j]);
      const ExpertPlacement::Copy* best = &copies[0];
      if (copies.size() > 1) {
        auto goes_to = [&](int w) {
          for (int i = 0; i < j; ++i) {
            if (dest[t * k + i] == w) return true;
          }
          return false;
        };
        auto rotated = [&](int w) {
          return (w - sender % num_workers + num_workers) % num_workers;
        };
        for (const ExpertPlacement::Copy& c : copies.subspan(1)) {
          const int64_t a = given[c.worker], b = given[best->worker];
          if (a != b) {
            if (a < b) best = &c;
            continue;
          }
          const bool ca = goes_to(c.worker), cb = goes_to(best->worker);
          if (ca != cb) {
            if (ca) best = &c;
            continue;
          }
          if (rotated(c.worker) < rotated(best->worker)) best = &c;
        }
      }
      dest[t * k + j] = best->worker;
      local[t * k + j] = best->local;
      ++given[best->worker];
    }
  }
}

}  // namespace epserve::worker
