// Rank 0's coordinator: a worker's death. The workers' pids, a thread that watches them
// (pidfds, or kill(pid, 0) where the kernel has none), what a death does to the batch under
// way (a new cancel generation) and to the placements (the survivors'), and the wait for the
// survivors. The batch life cycle is in coordinator.cc, the signals in coordinator_signals.cc.
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"
#include "worker/coordinator.h"
#include "worker/placement.h"

namespace epserve::worker {
namespace {

// A pidfd for `pid` (readable once the process has ended), or -1 where the kernel has none.
int OpenPidfd(int64_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  (void)pid;
  return -1;
#endif
}

}  // namespace

Coordinator::~Coordinator() {
  if (watch_.joinable()) {
    const uint64_t one = 1;
    if (write(watch_stop_fd_, &one, sizeof(one)) < 0) common::LogError("ending the worker watch");
    watch_.join();
  }
  if (watch_stop_fd_ >= 0) close(watch_stop_fd_);
}

absl::Status Coordinator::WaitForWorkers(absl::Time deadline) {
  EPSERVE_RETURN_IF_ERROR(
      heap_.SignalSet(0, regions_.front_end_pid, static_cast<uint64_t>(getpid())));
  shmem::WaitOptions wait;
  wait.max_sleep = absl::Milliseconds(5);
  const int num_workers = regions_.plan.shape().num_workers;
  for (int w = 0; w < num_workers; ++w) {
    EPSERVE_RETURN_IF_ERROR(heap_.WaitSignal(HeapRegions::Signal(regions_.ready, w), 1, deadline,
                                             "weights loaded by worker", w, wait));
  }
  workers_read_cuda_ = true;
  workers_read_shm_ = true;
  for (int w = 0; w < num_workers; ++w) {
    const uint64_t ready = heap_.SignalLoad(HeapRegions::Signal(regions_.ready, w));
    if ((ready & HeapRegions::kReadyReadsCuda) == 0) workers_read_cuda_ = false;
    if ((ready & HeapRegions::kReadyReadsShm) == 0) workers_read_shm_ = false;
  }
  // Only the shm heap has every worker on this host, and survives one's death.
  if (heap_.backend() != shmem::HeapBackend::kShm || watch_.joinable()) return absl::OkStatus();
  std::vector<int> pidfds(num_workers, -1);
  std::vector<int64_t> pids(num_workers, 0);
  for (int w = 0; w < num_workers; ++w) {
    pids[w] = static_cast<int64_t>(heap_.SignalLoad(HeapRegions::Signal(regions_.pids, w)));
    pidfds[w] = OpenPidfd(pids[w]);
  }
  watch_stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (watch_stop_fd_ < 0) {
    for (int fd : pidfds) {
      if (fd >= 0) close(fd);
    }
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  watch_ = std::thread([this, pidfds, pids] {
    common::NameThisThread("ep-death-watch");
    Watch(pidfds, pids);
  });
  return absl::OkStatus();
}

void Coordinator::Watch(std::vector<int> pidfds, std::vector<int64_t> pids) {
  const int num_workers = static_cast<int>(pidfds.size());
  std::vector<bool> gone(num_workers, false);
  while (true) {
    // Workers without a pidfd (a kernel before 5.3) are probed with kill(pid, 0) every 20 ms.
    std::vector<pollfd> fds = {{watch_stop_fd_, POLLIN, 0}};
    std::vector<int> of;  // worker of fds[i + 1]
    bool probe = false;
    for (int w = 0; w < num_workers; ++w) {
      if (gone[w]) continue;
      if (pidfds[w] >= 0) {
        fds.push_back({pidfds[w], POLLIN, 0});
        of.push_back(w);
      } else {
        probe = true;
      }
    }
    const int ready = poll(fds.data(), fds.size(), probe ? 20 : -1);
    if (ready < 0 && errno != EINTR) {
      common::LogError(absl::StrCat("watching the workers: poll: ", std::strerror(errno)));
      break;
    }
    if (fds[0].revents != 0) break;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int w = of[i - 1];
      gone[w] = true;
      OnDeath(w, pids[w]);
    }
    for (int w = 0; probe && w < num_workers; ++w) {
      if (!gone[w] && pidfds[w] < 0 && kill(static_cast<pid_t>(pids[w]), 0) != 0 &&
          errno == ESRCH) {
        gone[w] = true;
        OnDeath(w, pids[w]);
      }
    }
  }
  for (int fd : pidfds) {
    if (fd >= 0) close(fd);
  }
}

void Coordinator::OnDeath(int w, int64_t pid) {
  const int num_workers = regions_.plan.shape().num_workers;
  WorkerSet live;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    live_.Remove(w);
    live = live_;
  }
  ++lost_;
  // A new generation ends the waits of the batch under way, here and on every worker.
  const uint64_t generation = shmem::SignalLoad(&cancel_word_) + 1;
  for (int i = 0; i < num_workers; ++i) {
    uint64_t* cancel = heap_.DirectAs<uint64_t>(RankOfWorker(i), regions_.cancel);
    if (cancel != nullptr) shmem::SignalStore(cancel, generation);
  }
  shmem::SignalStore(&cancel_word_, generation);
  const absl::Status survivable = SurvivorPlacements(live).status();
  common::LogError(absl::StrCat(
      "worker ", w, " (rank ", RankOfWorker(w), ", pid ", pid,
      ") died; live workers: ", live.List(num_workers),
      survivable.ok() ? "; serving on with them" : absl::StrCat("; ", survivable.message())));
  if (!survivable.ok()) {
    healthy_ = false;
    if (on_fatal_death_) on_fatal_death_(std::string(survivable.message()));
  }
}

WorkerSet Coordinator::live_workers() const {
  std::lock_guard<std::mutex> lock(live_mu_);
  return live_;
}

absl::StatusOr<std::vector<ExpertPlacement>> Coordinator::SurvivorPlacements(
    const WorkerSet& live) const {
  if (live.Count() == 0) return absl::UnavailableError("no worker is left");
  if (regions_.plan.shared_expert_split()) {
    return absl::UnavailableError(
        "the shared expert is split over every worker, so a slice of it is gone");
  }
  // No placements given: every layer is contiguous.
  std::vector<ExpertPlacement> contiguous;
  if (placements_.empty()) {
    EPSERVE_ASSIGN_OR_RETURN(ExpertPlacement c,
                             ExpertPlacement::Contiguous(regions_.plan.shape().num_experts,
                                                         regions_.plan.shape().num_workers));
    contiguous.push_back(std::move(c));
  }
  const std::vector<ExpertPlacement>& all = placements_.empty() ? contiguous : placements_;
  std::vector<ExpertPlacement> only;
  for (size_t l = 0; l < all.size(); ++l) {
    absl::StatusOr<ExpertPlacement> p = all[l].OnlyOn(live);
    if (!p.ok()) {
      return absl::UnavailableError(absl::StrCat("served layer ", l, ": ", p.status().message(),
                                                 " (--redundant-experts places second copies)"));
    }
    only.push_back(*std::move(p));
  }
  if (placements_.empty()) only.clear();  // the workers serve contiguous layers
  return only;
}

absl::Status Coordinator::UseLiveWorkers(const WorkerSet& live) {
  if (live == serving_live_) return absl::OkStatus();
  absl::StatusOr<std::vector<ExpertPlacement>> only = SurvivorPlacements(live);
  if (!only.ok()) return Fail(only.status().message());
  survivor_placements_ = *std::move(only);
  serving_live_ = live;
  common::LogInfo(
      absl::StrCat("serving with workers ", live.List(regions_.plan.shape().num_workers)));
  return absl::OkStatus();
}

absl::Status Coordinator::WaitForSurvivors(absl::Time deadline, const WorkerSet& posted) {
  while (true) {
    const uint64_t generation = shmem::SignalLoad(&cancel_word_);
    const WorkerSet alive = live_workers();
    WorkerSet survivors;
    for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
      if (posted.Has(w) && alive.Has(w)) survivors.Add(w);
    }
    absl::Status s = WaitDone(deadline, survivors, generation);
    if (s.ok()) return s;
    // Another death: wait again, for the workers still alive.
    if (shmem::SignalLoad(&cancel_word_) == generation || abort_.load()) {
      return FailBatch(s, survivors);
    }
  }
}

}  // namespace epserve::worker
