// Rank 0's coordinator: its signals to the workers (rows announced, batches and control ops
// posted, their ends waited for, heartbeats) and the control steps of a weight swap and of
// the stop. The batch life cycle is in coordinator.cc, a worker's death in
// coordinator_deaths.cc.
#include <algorithm>
#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/coordinator.h"
#include "worker/placement.h"

namespace epserve::worker {

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
    if (posted.Has(i) && reports[i].status_code != 0) return reports[i].ToStatus();
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
      return reports[w].ToStatus();
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
