#include "worker/coordinator.h"
#include "worker/placement.h"

#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"

namespace epserve::worker {
namespace {

// What a worker wrote into its report's message (not NUL-terminated when full).
std::string ReportMessage(const WorkerReport& report) {
  return std::string(report.message, strnlen(report.message, sizeof(report.message)));
}

absl::Status ReportStatus(const WorkerReport& report) {
  return absl::Status(static_cast<absl::StatusCode>(report.status_code), ReportMessage(report));
}

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

Coordinator::Coordinator(shmem::SymmetricHeap& heap, const HeapRegions& regions,
                         std::vector<ExpertPlacement> placements)
    : heap_(heap),
      regions_(regions),
      placements_(std::move(placements)),
      serving_live_(WorkerSet::All(regions.plan.shape().num_workers)),
      live_(serving_live_) {}

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

absl::Status Coordinator::AnnounceRows(int64_t total, const WorkerSet& live, int slot,
                                       uint64_t copy_id) {
  const int num_workers = regions_.plan.shape().num_workers;
  for (int w = 0; w < num_workers; ++w) {
    if (!live.Has(w)) continue;
    RowsAhead ahead{};
    ahead.copy_id = copy_id;
    ahead.slot = slot;
    ahead.num_rows =
        RowSplit(total, w + 1, num_workers, live) - RowSplit(total, w, num_workers, live);
    EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w),
                                      regions_.rows_ahead + (copy_id % 2) * sizeof(RowsAhead),
                                      &ahead, sizeof(ahead)));
    EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(RankOfWorker(w), regions_.rows_ahead_seq, copy_id));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::Post(BatchOp op, int layer_pos, int64_t total_rows, absl::Time deadline,
                               const WorkerSet& live, uint64_t generation, int slot,
                               uint64_t copy_id) {
  const int num_workers = regions_.plan.shape().num_workers;
  ++seq_;
  // Workers give up a little before rank 0 does, so their reports arrive in time.
  const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
  const absl::Time worker_deadline = deadline - std::min(left / 5, absl::Milliseconds(100));
  for (int w = 0; w < num_workers; ++w) {
    if (!live.Has(w)) continue;
    const int64_t begin = RowSplit(total_rows, w, num_workers, live);
    const int64_t end = RowSplit(total_rows, w + 1, num_workers, live);
    BatchDescriptor desc{};
    desc.op = op;
    desc.layer_pos = layer_pos;
    desc.row_start = begin;
    desc.num_rows = end - begin;
    desc.deadline_unix_us = absl::ToUnixMicros(worker_deadline);
    desc.live = live;
    desc.generation = generation;
    desc.slot = slot;
    desc.copy_id = copy_id;
    EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w), regions_.descriptor, &desc, sizeof(desc)));
    EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(RankOfWorker(w), regions_.batch_seq, seq_));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::WaitDone(absl::Time deadline, const WorkerSet& workers,
                                   uint64_t generation) {
  shmem::WaitOptions wait;
  wait.cancel = &abort_;
  wait.cancel_signal = &cancel_word_;
  wait.cancel_above = generation;
  // A batch runs for milliseconds to seconds; polling every 50 us throughout cost rank 0
  // about 8% of a core (20,000 wake-ups a second) on the cores the workers compute on.
  wait.sleep_fraction = 1.0 / 64;
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (!workers.Has(w)) continue;
    EPSERVE_RETURN_IF_ERROR(heap_.WaitSignal(HeapRegions::Signal(regions_.done_seq, w), seq_,
                                             deadline, "the end of the batch on worker", w, wait));
  }
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

int Coordinator::StalledWorkers(absl::Duration timeout) {
  const int w = regions_.plan.shape().num_workers;
  uint64_t* beats = heap_.DirectAs<uint64_t>(0, regions_.heartbeats);
  if (beats == nullptr || heap_.backend() != shmem::HeapBackend::kShm) return -1;
  const WorkerSet live = live_workers();
  std::lock_guard<std::mutex> lock(beat_mu_);
  const absl::Time now = absl::Now();
  if (last_beat_.empty()) {
    last_beat_.assign(w, 0);
    beat_seen_.assign(w, now);
  }
  int stalled = 0;
  for (int i = 0; i < w; ++i) {
    const uint64_t beat =
        std::atomic_ref<uint64_t>(beats[HeapRegions::Signal(0, i) / sizeof(uint64_t)])
            .load(std::memory_order_relaxed);
    if (beat != last_beat_[i]) {
      last_beat_[i] = beat;
      beat_seen_[i] = now;
    } else if (now - beat_seen_[i] > timeout && live.Has(i)) {
      ++stalled;
    }
  }
  return stalled;
}

absl::Status Coordinator::Fail(absl::string_view why) {
  healthy_ = false;
  const std::string message = absl::StrCat("the expert exchange failed in batch ", seq_, ": ", why,
                                           "; the service needs a restart");
  common::LogError(message);
  return absl::UnavailableError(message);
}

absl::StatusOr<BatchTrace> Coordinator::Run(int layer_pos, std::span<const RowChunk> chunks,
                                            absl::Time deadline) {
  EPSERVE_ASSIGN_OR_RETURN(const uint64_t ticket, Start(layer_pos, chunks, deadline));
  return Finish(ticket);
}

absl::StatusOr<uint64_t> Coordinator::Start(int layer_pos, std::span<const RowChunk> chunks,
                                            absl::Time deadline) {
  if (!healthy_) {
    return absl::UnavailableError(
        "the expert workers stopped answering; the service needs a restart");
  }
  const ExchangeShape& shape = regions_.plan.shape();
  int64_t total = 0;
  for (const RowChunk& c : chunks) total += c.rows;
  if (total < 1 || total > shape.max_batch_tokens) {
    return absl::InternalError(
        absl::StrCat("batch of ", total, " rows outside [1, ", shape.max_batch_tokens, "]"));
  }
  if (flight_.size() >= HeapRegions::kSlots) {
    return absl::FailedPreconditionError(
        absl::StrCat("Start with ", flight_.size(), " batches in flight already"));
  }
  InFlight b;
  b.ticket = next_ticket_++;
  b.layer_pos = layer_pos;
  b.chunks.assign(chunks.begin(), chunks.end());
  b.total = total;
  b.start = absl::Now();
  b.deadline = std::min(deadline, b.start + regions_.plan.timeout());
  // The slot the batch before it does not use (slots alternate).
  b.slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % HeapRegions::kSlots;
  if (absl::Status s = PlaceRows(b); !s.ok()) return s;
  if (!b.slices) {
    absl::Status s = Scatter(b.chunks, b.total, b.live, b.slot);
    if (!s.ok()) return Fail(s.ToString());
    b.trace.scatter_ns = absl::ToInt64Nanoseconds(absl::Now() - b.start);
  }
  // The workers run one batch at a time: post now only when none is in flight.
  const bool busy = std::any_of(flight_.begin(), flight_.end(), [](const InFlight& f) {
    return f.state != InFlight::State::kDone;
  });
  if (busy && !b.slices) {
    // The workers may upload these rows while they compute the batch before.
    b.copy_id = ++copies_announced_;
    if (absl::Status s = AnnounceRows(b.total, b.live, b.slot, b.copy_id); !s.ok()) {
      return Fail(s.ToString());
    }
  }
  flight_.push_back(std::move(b));
  if (!busy && !flight_.back().slices) PostPending(flight_.back());
  return flight_.back().ticket;
}

absl::Status Coordinator::PlaceRows(InFlight& b) {
  // The generation before the live set: a death between the two only cancels this attempt.
  b.generation = shmem::SignalLoad(&cancel_word_);
  b.live = live_workers();
  EPSERVE_RETURN_IF_ERROR(UseLiveWorkers(b.live));
  // After a worker's death the survivors' input regions hold fewer rows than a batch may
  // have: such a batch runs in slices (RunSlices).
  b.slices = b.total > RowsThatFit(b.live);
  return absl::OkStatus();
}

void Coordinator::PostPending(InFlight& b) {
  auto done = [&](absl::Status s) {
    b.result = std::move(s);
    b.state = InFlight::State::kDone;
  };
  if (!healthy_) {
    return done(abort_.load() ? absl::CancelledError("the server is shutting down")
                              : absl::UnavailableError("the expert workers stopped answering; "
                                                       "the service needs a restart"));
  }
  if (shmem::SignalLoad(&cancel_word_) != b.generation || !(live_workers() == b.live)) {
    // A worker died since its rows were copied: split them over the survivors.
    if (absl::Status s = PlaceRows(b); !s.ok()) return done(s);
    b.copy_id = 0;  // a new copy, not announced
    if (b.slices) return;
    const absl::Time t0 = absl::Now();
    if (absl::Status s = Scatter(b.chunks, b.total, b.live, b.slot); !s.ok()) {
      return done(Fail(s.ToString()));
    }
    b.trace.scatter_ns += absl::ToInt64Nanoseconds(absl::Now() - t0);
  }
  if (absl::Status s = Post(BatchOp::kRun, b.layer_pos, b.total, b.deadline, b.live, b.generation,
                            b.slot, b.copy_id);
      !s.ok()) {
    return done(Fail(s.ToString()));
  }
  b.state = InFlight::State::kPosted;
}

void Coordinator::Complete(InFlight& b) {
  if (b.state == InFlight::State::kDone) return;
  InFlight* next = flight_.size() > 1 && &flight_.front() == &b ? &flight_[1] : nullptr;
  auto post_next = [&] {
    if (next != nullptr && next->state == InFlight::State::kScattered && !next->slices) {
      PostPending(*next);
    }
  };
  if (b.state == InFlight::State::kScattered && !b.slices) PostPending(b);
  if (b.state == InFlight::State::kDone) return post_next();
  if (b.slices) {
    b.result = RunSlices(b.layer_pos, b.chunks, b.total, b.deadline, b.start, b.slot, false);
    b.state = InFlight::State::kDone;
    return post_next();
  }
  // Posted: wait for it.
  absl::Status s = WaitDone(b.deadline, b.live, b.generation);
  if (absl::IsCancelled(s) && !abort_.load()) {
    // A worker died under it and every survivor has left it: again over the survivors
    // (in slices where they must), once, if the deadline leaves at least the time spent.
    s = WaitForSurvivors(b.deadline, b.live);
    if (!s.ok()) {
      b.result = s;
    } else if (!MayRetry(b.deadline, b.start)) {
      b.result = absl::UnavailableError(
          "a worker died while this batch ran; it was abandoned (the batch was cancelled); the "
          "service goes on with the live workers");
    } else {
      b.result = RunSlices(b.layer_pos, b.chunks, b.total, b.deadline, b.start, b.slot, true);
    }
    b.state = InFlight::State::kDone;
    return post_next();
  }
  if (!s.ok()) {
    b.result = FailBatch(s, b.live);
    b.state = InFlight::State::kDone;
    return post_next();
  }
  BatchTrace trace = std::move(b.trace);
  s = CollectReports(trace, b.live);
  // The workers are free: the next batch runs while this one's output is copied out.
  post_next();
  if (s.ok()) {
    const absl::Time t0 = absl::Now();
    Gather(b.chunks, b.slot);
    trace.gather_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);
    b.result = std::move(trace);
  } else {
    b.result = s;
  }
  b.state = InFlight::State::kDone;
}

absl::StatusOr<BatchTrace> Coordinator::Finish(uint64_t ticket) {
  if (flight_.empty() || flight_.front().ticket != ticket) {
    return absl::InternalError(absl::StrCat("Finish(", ticket, ") out of the order of Start"));
  }
  Complete(flight_.front());
  absl::StatusOr<BatchTrace> result = std::move(flight_.front().result);
  flight_.pop_front();
  return result;
}

bool Coordinator::EndedPosted(int w) {
  return heap_.SignalLoad(HeapRegions::Signal(regions_.done_seq, w)) >= seq_;
}

bool Coordinator::Finished(uint64_t ticket) {
  if (flight_.empty() || flight_.front().ticket != ticket) return false;
  const InFlight& b = flight_.front();
  if (b.state != InFlight::State::kPosted) return true;
  if (!healthy_ || abort_.load() || shmem::SignalLoad(&cancel_word_) > b.generation ||
      absl::Now() >= b.deadline) {
    return true;
  }
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (b.live.Has(w) && !EndedPosted(w)) {
      return false;
    }
  }
  return true;
}

void Coordinator::Drain() {
  for (InFlight& b : flight_) Complete(b);
}

int64_t Coordinator::RowsThatFit(const WorkerSet& live) const {
  // After a worker's death the survivors' input regions hold fewer rows than a batch may
  // have: a batch runs in slices that fit them (and, where --max-recv-tokens-per-rank sized
  // their receive buffers below a batch, that one survivor can take whole).
  const int64_t fit = regions_.plan.max_rows_per_worker() * live.Count();
  return live.Count() < regions_.plan.shape().num_workers
             ? std::min(fit, regions_.plan.recv_capacity())
             : fit;
}

bool Coordinator::MayRetry(absl::Time deadline, absl::Time started) {
  return healthy_ && deadline - absl::Now() >= absl::Now() - started &&
         SurvivorPlacements(live_workers()).ok();
}

absl::StatusOr<BatchTrace> Coordinator::RunSlices(int layer_pos, std::span<const RowChunk> chunks,
                                                  int64_t total, absl::Time deadline,
                                                  absl::Time started, int slot, bool retried) {
  BatchTrace all;
  std::vector<RowChunk> slice;
  for (int64_t done = 0; done < total;) {
    // The generation before the live set: a death between the two only cancels this attempt.
    const uint64_t generation = shmem::SignalLoad(&cancel_word_);
    const WorkerSet live = live_workers();
    EPSERVE_RETURN_IF_ERROR(UseLiveWorkers(live));
    const int64_t rows = std::min(RowsThatFit(live), total - done);
    Slice(chunks, done, rows, slice);
    bool died = false;
    absl::StatusOr<BatchTrace> trace =
        RunOnce(layer_pos, slice, rows, deadline, live, generation, died, slot);
    if (died && healthy_) {
      // A worker died under the slice and every survivor has left it. Run it again over the
      // survivors, once per batch, if the deadline leaves at least the time spent so far.
      if (retried || !MayRetry(deadline, started)) {
        return absl::UnavailableError(
            absl::StrCat("a worker died while this batch ran; it was abandoned (",
                         trace.status().message(), "); the service goes on with the live workers"));
      }
      retried = true;
      continue;
    }
    if (!trace.ok()) return trace.status();
    if (done == 0 && rows == total) return trace;
    Accumulate(all, *trace);
    done += rows;
  }
  return all;
}

void Coordinator::Slice(std::span<const RowChunk> chunks, int64_t begin, int64_t rows,
                        std::vector<RowChunk>& out) const {
  const int64_t hidden = regions_.plan.shape().hidden;
  const int k = regions_.plan.shape().top_k;
  out.clear();
  int64_t at = 0;  // first row of the chunk
  for (const RowChunk& c : chunks) {
    const int64_t from = std::max(begin, at), to = std::min(begin + rows, at + c.rows);
    if (from < to) {
      const int64_t skip = from - at;
      RowChunk part = c;
      part.rows = to - from;
      part.input =
          static_cast<const char*>(c.input) + skip * hidden * common::ElementBytes(c.input_type);
      part.output =
          static_cast<char*>(c.output) + skip * hidden * common::ElementBytes(c.output_type);
      if (part.topk_ids != nullptr) part.topk_ids += skip * k;
      if (part.topk_weights != nullptr) part.topk_weights += skip * k;
      out.push_back(part);
    }
    at += c.rows;
  }
}

void Coordinator::Accumulate(BatchTrace& all, const BatchTrace& part) {
  all.scatter_ns += part.scatter_ns;
  all.gather_ns += part.gather_ns;
  all.dispatch_bytes += part.dispatch_bytes;
  all.combine_bytes += part.combine_bytes;
  all.workers = part.workers;  // the last slice's: after any death under an earlier one
  auto add = [](auto& to, const auto& from) {
    if (to.size() < from.size()) to.resize(from.size());
    for (size_t i = 0; i < from.size(); ++i) to[i] += from[i];
  };
  add(all.expert_tokens, part.expert_tokens);
  add(all.worker_pairs, part.worker_pairs);
  if (all.stage_ns.size() < part.stage_ns.size()) all.stage_ns.resize(part.stage_ns.size());
  for (size_t w = 0; w < part.stage_ns.size(); ++w) {
    for (int st = 0; st < kNumWorkerStages; ++st) all.stage_ns[w][st] += part.stage_ns[w][st];
  }
}

absl::StatusOr<BatchTrace> Coordinator::RunOnce(int layer_pos, std::span<const RowChunk> chunks,
                                                int64_t total, absl::Time deadline,
                                                const WorkerSet& live, uint64_t generation,
                                                bool& died, int slot) {
  BatchTrace trace;
  absl::Time t0 = absl::Now();
  absl::Status s = Scatter(chunks, total, live, slot);
  if (!s.ok()) return Fail(s.ToString());
  trace.scatter_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);

  s = Post(BatchOp::kRun, layer_pos, total, deadline, live, generation, slot);
  if (!s.ok()) return Fail(s.ToString());
  s = WaitDone(deadline, live, generation);
  if (absl::IsCancelled(s) && !abort_.load()) {
    died = true;
    EPSERVE_RETURN_IF_ERROR(WaitForSurvivors(deadline, live));
    return s;
  }
  if (!s.ok()) return FailBatch(s, live);
  EPSERVE_RETURN_IF_ERROR(CollectReports(trace, live));

  t0 = absl::Now();
  Gather(chunks, slot);
  trace.gather_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);
  return trace;
}

absl::Status Coordinator::Scatter(std::span<const RowChunk> chunks, int64_t total,
                                  const WorkerSet& live, int slot) {
  const ExchangeShape& shape = regions_.plan.shape();
  const int num_workers = shape.num_workers;
  const size_t row_bytes = static_cast<size_t>(shape.hidden) * sizeof(float);
  // Batch row r goes to worker w with begin(w) <= r < end(w). Where every worker's segment
  // is load/store (shm), the copies (converting to FP32 on the way) run on copy_threads_
  // threads; else as Puts, of rows converted here first where they are not FP32.
  copies_.clear();
  bool direct = true;
  int64_t row = 0;
  int w = 0;
  for (const RowChunk& c : chunks) {
    const size_t src_row_bytes = shape.hidden * common::ElementBytes(c.input_type);
    for (int64_t done = 0; done < c.rows;) {
      while (row >= RowSplit(total, w + 1, num_workers, live)) ++w;
      const int64_t begin = RowSplit(total, w, num_workers, live);
      const int64_t end = RowSplit(total, w + 1, num_workers, live);
      const int64_t take = std::min(c.rows - done, end - row);
      const size_t offset = regions_.Input(slot) + (row - begin) * row_bytes;
      const char* src = static_cast<const char*>(c.input) + done * src_row_bytes;
      const size_t count = static_cast<size_t>(take * shape.hidden);
      void* dst = direct ? heap_.Direct(RankOfWorker(w), offset) : nullptr;
      if (dst != nullptr) {
        copies_.push_back({dst, common::ElementType::kFp32, src, c.input_type, count});
      } else {
        direct = false;
        if (c.input_type == common::ElementType::kFp32) {
          EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w), offset, src, take * row_bytes));
        } else {
          put_rows_.resize(count);
          common::ToFp32(c.input_type, src, put_rows_.data(), count);
          EPSERVE_RETURN_IF_ERROR(
              heap_.Put(RankOfWorker(w), offset, put_rows_.data(), take * row_bytes));
          // A Put may complete later: put_rows_ is reused once this one is done.
          EPSERVE_RETURN_IF_ERROR(heap_.Flush(RankOfWorker(w)));
        }
      }
      row += take;
      done += take;
    }
  }
  common::ParallelConvert(copy_threads_, copies_);
  return absl::OkStatus();
}

absl::Status Coordinator::FailBatch(const absl::Status& wait, const WorkerSet& posted) {
  if (absl::IsCancelled(wait) && abort_.load()) {
    healthy_ = false;
    return wait;
  }
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.reports);
  std::string why = std::string(wait.message());
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (!posted.Has(w)) continue;
    if (!EndedPosted(w)) {
      absl::StrAppend(&why, "; worker ", w, " (rank ", RankOfWorker(w), ") did not finish");
    } else if (reports[w].status_code != 0) {
      absl::StrAppend(&why, "; ", ReportMessage(reports[w]));
    }
  }
  return Fail(why);
}

absl::Status Coordinator::CollectReports(BatchTrace& trace, const WorkerSet& posted) {
  const ExchangeShape& shape = regions_.plan.shape();
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.reports);
  trace.stage_ns.resize(shape.num_workers);
  const size_t dispatch_row_bytes = regions_.plan.dispatch_row_bytes();
  const size_t combine_row_bytes = regions_.plan.combine_row_bytes();
  std::string timeouts;
  absl::Status first_error;
  for (int w = 0; w < shape.num_workers; ++w) {
    if (!posted.Has(w)) continue;
    const WorkerReport& report = reports[w];
    if (report.status_code != 0) {
      if (static_cast<absl::StatusCode>(report.status_code) ==
          absl::StatusCode::kDeadlineExceeded) {
        absl::StrAppend(&timeouts, timeouts.empty() ? "" : "; ", ReportMessage(report));
      } else if (first_error.ok()) {
        first_error = ReportStatus(report);
      }
      continue;
    }
    std::copy(std::begin(report.stage_ns), std::end(report.stage_ns), trace.stage_ns[w].begin());
    trace.dispatch_bytes += report.rows_received * static_cast<int64_t>(dispatch_row_bytes);
    // One row back per pair, and per received row where the shared expert is split.
    const int64_t combined =
        report.pairs + (regions_.plan.shared_expert_split() ? report.rows_received : 0);
    trace.combine_bytes += combined * static_cast<int64_t>(combine_row_bytes);
  }
  if (!timeouts.empty()) return Fail(timeouts);
  if (!first_error.ok()) return first_error;
  const int64_t* expert_tokens = heap_.LocalAs<int64_t>(regions_.expert_tokens);
  trace.expert_tokens.assign(shape.num_experts, 0);
  trace.worker_pairs.assign(shape.num_workers, 0);
  trace.workers = posted;
  for (int w = 0; w < shape.num_workers; ++w) {
    if (!posted.Has(w)) continue;  // its row is what it wrote before it died
    for (int e = 0; e < shape.num_experts; ++e) {
      const int64_t pairs = expert_tokens[static_cast<size_t>(w) * shape.num_experts + e];
      trace.expert_tokens[e] += pairs;
      trace.worker_pairs[w] += pairs;
    }
  }
  return absl::OkStatus();
}

void Coordinator::Gather(std::span<const RowChunk> chunks, int slot) {
  const ExchangeShape& shape = regions_.plan.shape();
  const size_t k = static_cast<size_t>(shape.top_k);
  const float* out = heap_.LocalAs<float>(regions_.Output(slot));
  const int32_t* ids = heap_.LocalAs<int32_t>(regions_.TopkIds(slot));
  const float* weights = heap_.LocalAs<float>(regions_.TopkWeights(slot));
  copies_.clear();
  for (const RowChunk& c : chunks) {
    copies_.push_back({c.output, c.output_type, out, common::ElementType::kFp32,
                       static_cast<size_t>(c.rows * shape.hidden)});
    out += c.rows * shape.hidden;
    if (c.topk_ids != nullptr) std::memcpy(c.topk_ids, ids, c.rows * k * sizeof(int32_t));
    if (c.topk_weights != nullptr) std::memcpy(c.topk_weights, weights, c.rows * k * sizeof(float));
    ids += c.rows * k;
    weights += c.rows * k;
  }
  common::ParallelConvert(copy_threads_, copies_);
}

absl::Status Coordinator::Control(BatchOp op, absl::Time deadline) {
  Drain();
  const uint64_t generation = shmem::SignalLoad(&cancel_word_);
  WorkerSet posted = live_workers();
  absl::Status s = Post(op, 0, 0, deadline, posted, generation);
  if (s.ok()) s = WaitDone(deadline, posted, generation);
  if (absl::IsCancelled(s) && !abort_.load()) {
    // A worker died meanwhile: what counts is that every survivor did it.
    s = WaitForSurvivors(deadline, posted);
    if (!s.ok()) return s;
    posted = live_workers();
  }
  if (!s.ok()) return Fail(s.ToString());
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.reports);
  for (int i = 0; i < regions_.plan.shape().num_workers; ++i) {
    if (posted.Has(i) && reports[i].status_code != 0) return ReportStatus(reports[i]);
  }
  return absl::OkStatus();
}

absl::Status Coordinator::BeginStage(const std::string& model, uint64_t seed, absl::Time deadline,
                                     const std::vector<ExpertPlacement>* placements) {
  Drain();  // the table below goes into input slot 0
  if (!healthy_) {
    return absl::UnavailableError(
        "the expert workers stopped answering; the service needs a restart");
  }
  if (model.empty() || model.size() > ControlMessage::kMaxModel) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model name must be 1 to ", ControlMessage::kMaxModel, " bytes, got ", model.size()));
  }
  ControlMessage message{};
  message.seed = seed;
  message.model_bytes = static_cast<uint32_t>(model.size());
  std::memcpy(message.model, model.data(), model.size());
  std::vector<int32_t> table;
  staged_placements_.clear();
  if (placements != nullptr) {
    table = EncodePlacements(*placements);
    if (table.size() * sizeof(int32_t) > regions_.InputBytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the placement table (", table.size() * sizeof(int32_t),
                       " bytes) does not fit a worker's input region (", regions_.InputBytes(),
                       " bytes; --max-batch-tokens sizes it)"));
    }
    message.placement_words = static_cast<uint32_t>(table.size());
    staged_placements_ = *placements;
  }
  const WorkerSet live = live_workers();
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (!live.Has(w)) continue;
    absl::Status s = heap_.Put(RankOfWorker(w), regions_.control, &message, sizeof(message));
    // The table goes where the worker's next batch rows would: the worker copies it out when
    // it takes the kStage, before any later batch.
    if (s.ok() && !table.empty()) {
      s = heap_.Put(RankOfWorker(w), regions_.Input(0), table.data(),
                    table.size() * sizeof(int32_t));
    }
    if (!s.ok()) return Fail(s.ToString());
  }
  absl::Status s = Control(BatchOp::kStage, deadline);
  stage_seq_ = seq_;
  return s;
}

absl::StatusOr<bool> Coordinator::StageDone() {
  if (stage_seq_ == 0) return absl::FailedPreconditionError("no weight swap under way");
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.stage_reports);
  const WorkerSet live = live_workers();
  bool all = true;
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (!live.Has(w)) continue;
    if (heap_.SignalLoad(HeapRegions::Signal(regions_.staged, w)) < stage_seq_) {
      all = false;
    } else if (reports[w].status_code != 0) {
      return ReportStatus(reports[w]);
    }
  }
  return all;
}

int64_t Coordinator::StagedBytes() const {
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.stage_reports);
  const WorkerSet live = live_workers();
  int64_t bytes = 0;
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (live.Has(w)) bytes += reports[w].weight_bytes;
  }
  return bytes;
}

absl::Status Coordinator::EndStage(bool use_new, absl::Time deadline) {
  stage_seq_ = 0;
  absl::Status s = Control(use_new ? BatchOp::kSwitch : BatchOp::kDiscard, deadline);
  if (use_new && s.ok() && !staged_placements_.empty()) {
    placements_.swap(staged_placements_);
    if (!survivor_placements_.empty()) {
      // The survivors' view of the new placements, on the next batch.
      survivor_placements_.clear();
      serving_live_ = WorkerSet::All(regions_.plan.shape().num_workers);
    }
  }
  staged_placements_.clear();
  if (use_new && !s.ok() && healthy_) {
    // Some workers may have switched and others not: answers could mix weights.
    return Fail(absl::StrCat("switching to the new weights failed: ", s.message()));
  }
  return s;
}

absl::Status Coordinator::SwapWeights(const std::string& model, uint64_t seed,
                                      absl::Time deadline) {
  absl::Status s = BeginStage(model, seed, deadline);
  while (s.ok()) {
    absl::StatusOr<bool> done = StageDone();
    if (!done.ok()) {
      s = done.status();
    } else if (*done) {
      return EndStage(true, deadline);
    } else if (absl::Now() > deadline) {
      s = absl::DeadlineExceededError("the workers did not load the new weights in time");
    } else {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  if (!healthy_) return s;
  absl::Status discarded = EndStage(false, deadline);
  return discarded.ok() || !healthy_ ? s : discarded;
}

absl::Status Coordinator::Stop(absl::Time deadline) {
  // Batches in flight end here (their Finish says so); workers still finishing an aborted
  // batch see the stop right after it.
  for (InFlight& b : flight_) {
    if (b.state == InFlight::State::kDone) continue;
    b.result = absl::CancelledError("the server is shutting down");
    b.state = InFlight::State::kDone;
  }
  abort_.store(false);
  const uint64_t generation = shmem::SignalLoad(&cancel_word_);
  const WorkerSet live = live_workers();
  absl::Status s = Post(BatchOp::kStop, 0, 0, deadline, live, generation);
  if (s.ok()) s = WaitDone(deadline, live, generation);
  return s;
}

}  // namespace epserve::worker
