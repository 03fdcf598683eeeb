// The front-end's changes of the served weights and placements while it serves: a weight swap
// (RepositoryModelLoad: SwapWeights, StageAndSwitch) and the online rebalance
// (--eplb-interval: RebalanceLoop, Rebalance), each through the coordinator's two-phase
// protocol between batches. Start-up, batches and shutdown are in front_end.cc.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "server/front_end.h"
#include "worker/eplb.h"

namespace epserve::server {
namespace {

// A layer's placement for `load` over the workers of `live` (all of them until one dies):
// DeepSeek's EPLB policy (worker::BalanceExperts) over the live workers, with as many
// redundant copies as still fit the slots each worker has room for, worker sets renamed to
// where most of their experts already are (worker::KeepInPlace on `current`); dead workers
// hold nothing; each expert keeps `min_copies` copies where they fit.
absl::StatusOr<worker::ExpertPlacement> PlaceOverLiveWorkers(const std::vector<double>& load,
                                                             const worker::ExpertPlacement& current,
                                                             const worker::WorkerSet& live,
                                                             const worker::ExchangeShape& shape,
                                                             int min_copies) {
  std::vector<int> ids;  // the live workers, in order
  for (int w = 0; w < shape.num_workers; ++w) {
    if (live.Has(w)) ids.push_back(w);
  }
  const int n = static_cast<int>(ids.size());
  const int slots = (shape.num_experts + shape.redundant_experts + shape.num_workers - 1) /
                    shape.num_workers;  // each worker's room
  const int redundant = std::min(
      {shape.redundant_experts, slots * n - shape.num_experts, shape.num_experts * (n - 1)});
  if (n == 0 || redundant < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        n, " live workers with room for ", slots, " experts each cannot hold ", shape.num_experts));
  }
  // As many copies of each expert as asked, where the live workers have room for them.
  const int copies =
      std::max(1, std::min({min_copies, n, (shape.num_experts + redundant) / shape.num_experts}));
  EPSERVE_ASSIGN_OR_RETURN(worker::BalancedPlacement b,
                           worker::BalanceExperts(load, n, redundant, copies));
  EPSERVE_ASSIGN_OR_RETURN(worker::ExpertPlacement balanced,
                           worker::ExpertPlacement::FromSlots(shape.num_experts, b.experts_of));
  std::vector<std::vector<int>> held(n);  // what each live worker holds now
  for (int i = 0; i < n; ++i)
    held[i].assign(current.experts(ids[i]).begin(), current.experts(ids[i]).end());
  EPSERVE_ASSIGN_OR_RETURN(worker::ExpertPlacement now,
                           worker::ExpertPlacement::FromSlots(shape.num_experts, held, true));
  const worker::ExpertPlacement kept = worker::KeepInPlace(balanced, now);
  std::vector<std::vector<int>> experts_of(shape.num_workers);
  for (int i = 0; i < n; ++i)
    experts_of[ids[i]].assign(kept.experts(i).begin(), kept.experts(i).end());
  return worker::ExpertPlacement::FromSlots(shape.num_experts, std::move(experts_of),
                                            /*idle_workers=*/true);
}

}  // namespace

absl::Status FrontEnd::StageAndSwitch(const std::string& model, uint64_t seed,
                                      const std::vector<worker::ExpertPlacement>* placements,
                                      bool between_requests, int64_t* bytes) {
  // Loading runs on the workers beside the batches; each coordinator step runs between
  // batches (exec_mu_), and the switch between requests where asked.
  const absl::Time deadline = absl::Now() + options_.weight_swap_timeout;
  auto between_batches = [&](auto step) -> decltype(step()) {
    std::lock_guard<std::mutex> exec(exec_mu_);
    if (stopping_.load()) return absl::UnavailableError("the server is shutting down");
    return step();
  };
  absl::Status status =
      between_batches([&] { return coordinator_->BeginStage(model, seed, deadline, placements); });
  while (status.ok()) {
    absl::StatusOr<bool> done = between_batches([&] { return coordinator_->StageDone(); });
    if (!done.ok()) {
      status = done.status();
    } else if (*done) {
      break;
    } else if (absl::Now() > deadline) {
      status = absl::DeadlineExceededError(
          absl::StrCat("the workers did not load the new weights within ",
                       absl::FormatDuration(options_.weight_swap_timeout)));
    } else {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  if (status.ok()) {
    *bytes = coordinator_->StagedBytes();
    auto end = [&] {
      return between_batches([&] { return coordinator_->EndStage(true, deadline); });
    };
    status = between_requests ? batcher_->RunBetweenRequests(end) : end();
  } else if (coordinator_->healthy()) {
    absl::Status discarded =
        between_batches([&] { return coordinator_->EndStage(false, deadline); });
    if (!discarded.ok()) status = discarded;
  }
  if (!status.ok() && !coordinator_->healthy()) {
    SetReady(false);
    metrics_->SetWorkersReady(0);
  }
  return status;
}

absl::Status FrontEnd::SwapWeights(const std::string& model, std::optional<uint64_t> seed) {
  std::lock_guard<std::mutex> lock(swap_mu_);
  const uint64_t s = seed.value_or(default_seed_);
  const absl::Time start = absl::Now();
  // The cheap checks first, here: the folder opens and has the served shape.
  {
    absl::StatusOr<std::unique_ptr<model::WeightSource>> next = open_model_(model, s);
    if (!next.ok()) return next.status();
    EPSERVE_RETURN_IF_ERROR(model::CheckSameShape(model_, (*next)->config()));
  }
  common::LogInfo(absl::StrCat("loading the weights of ", model.substr(0, 128), " (seed ", s,
                               ") on every worker"));
  int64_t bytes = 0;
  const absl::Status status = StageAndSwitch(model, s, nullptr, /*between_requests=*/true, &bytes);
  const absl::Duration took = absl::Now() - start;
  metrics_->ObserveWeightSwap(status.code(), took);
  if (!status.ok()) {
    common::LogWarning(absl::StrCat("the weights of ", model.substr(0, 128), " were not loaded (",
                                    absl::FormatDuration(took), "): ", status.ToString()));
    return status;
  }
  model_.source = model;
  serving_seed_ = s;
  common::LogInfo(absl::StrCat("serving the weights of ", model.substr(0, 128), " (seed ", s,
                               "), swapped in ", absl::FormatDuration(took)));
  return absl::OkStatus();
}

void FrontEnd::RebalanceLoop() {
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (
      !watch_cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return watch_stop_; })) {
    bool due = false;
    {
      std::lock_guard<std::mutex> eplb(eplb_mu_);
      due = eplb_batches_ >= options_.eplb.interval_batches;
    }
    if (!due) continue;
    lock.unlock();
    Rebalance();
    lock.lock();
  }
}

void FrontEnd::Rebalance() {
  std::lock_guard<std::mutex> lock(swap_mu_);
  std::vector<std::vector<double>> load;
  int64_t batches = 0;
  {
    std::lock_guard<std::mutex> eplb(eplb_mu_);
    load = eplb_load_;
    batches = eplb_batches_;
    for (std::vector<double>& l : eplb_load_) std::fill(l.begin(), l.end(), 0.0);
    eplb_batches_ = 0;
  }
  std::vector<worker::ExpertPlacement> current;
  worker::WorkerSet live;
  {
    std::lock_guard<std::mutex> exec(exec_mu_);
    current = coordinator_->placements();
    live = coordinator_->live_workers();
  }
  const worker::ExchangeShape& shape = coordinator_->shape();
  if (current.size() != load.size()) {
    absl::StatusOr<worker::ExpertPlacement> contiguous =
        worker::ExpertPlacement::Contiguous(shape.num_experts, shape.num_workers);
    if (!contiguous.ok()) return;
    current.assign(load.size(), *contiguous);
  }
  // The new placements, and the worst layer's expected balancedness before and after.
  std::vector<worker::ExpertPlacement> next;
  double before = 1, after = 1;
  for (size_t l = 0; l < load.size(); ++l) {
    absl::StatusOr<worker::ExpertPlacement> p =
        PlaceOverLiveWorkers(load[l], current[l], live, shape, options_.eplb.min_copies);
    if (!p.ok()) {
      common::LogWarning(absl::StrCat("rebalance: ", p.status().ToString()));
      metrics_->ObserveRebalance("failed", absl::ZeroDuration(), 0, nullptr);
      return;
    }
    before = std::min(before, worker::PlacementBalancedness(current[l], load[l]));
    after = std::min(after, worker::PlacementBalancedness(*p, load[l]));
    next.push_back(*std::move(p));
  }
  if (next == current || after - before < options_.eplb.min_gain) {
    metrics_->ObserveRebalance("skipped", absl::ZeroDuration(), 0, nullptr);
    return;
  }
  const absl::Time start = absl::Now();
  int64_t bytes = 0;
  const absl::Status status =
      StageAndSwitch(model_.source, serving_seed_, &next, /*between_requests=*/false, &bytes);
  const absl::Duration took = absl::Now() - start;
  if (!status.ok()) {
    metrics_->ObserveRebalance("failed", took, 0, nullptr);
    common::LogWarning(absl::StrCat("rebalance failed after ", absl::FormatDuration(took), ": ",
                                    status.ToString()));
    return;
  }
  metrics_->ObserveRebalance("done", took, bytes, &next);
  common::LogInfo(absl::StrCat("rebalanced the experts over the loads of ", batches, " batches in ",
                               absl::FormatDuration(took), ": expected worker balancedness ",
                               before, " -> ", after, ", ", bytes, " weight bytes loaded; layer ",
                               served_.layers[0], ": ", next[0].Describe()));
}

}  // namespace epserve::server
