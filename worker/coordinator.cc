#include "worker/coordinator.h"
#include "worker/placement.h"

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"
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

}  // namespace

absl::Status Coordinator::WaitForWorkers(absl::Time deadline) {
  shmem::WaitOptions wait;
  wait.max_sleep = absl::Milliseconds(5);
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    EPSERVE_RETURN_IF_ERROR(heap_.WaitSignal(HeapRegions::Signal(regions_.ready, w), 1, deadline,
                                             "weights loaded by worker", w, wait));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::Post(BatchOp op, int layer_pos, int64_t total_rows, absl::Time deadline) {
  const int num_workers = regions_.plan.shape().num_workers;
  ++seq_;
  // Workers give up a little before rank 0 does, so their reports arrive in time.
  const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
  const absl::Time worker_deadline = deadline - std::min(left / 5, absl::Milliseconds(100));
  for (int w = 0; w < num_workers; ++w) {
    const int64_t begin = RowSplit(total_rows, w, num_workers);
    const int64_t end = RowSplit(total_rows, w + 1, num_workers);
    BatchDescriptor desc{};
    desc.op = op;
    desc.layer_pos = layer_pos;
    desc.row_start = begin;
    desc.num_rows = end - begin;
    desc.deadline_unix_us = absl::ToUnixMicros(worker_deadline);
    EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w), regions_.descriptor, &desc, sizeof(desc)));
    EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(RankOfWorker(w), regions_.batch_seq, seq_));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::WaitDone(absl::Time deadline) {
  shmem::WaitOptions wait;
  wait.cancel = &abort_;
  // A batch runs for milliseconds to seconds; polling every 50 us throughout cost rank 0
  // about 8% of a core (20,000 wake-ups a second) on the cores the workers compute on.
  wait.sleep_fraction = 1.0 / 64;
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    EPSERVE_RETURN_IF_ERROR(heap_.WaitSignal(HeapRegions::Signal(regions_.done_seq, w), seq_,
                                             deadline, "the end of the batch on worker", w, wait));
  }
  return absl::OkStatus();
}

int Coordinator::StalledWorkers(absl::Duration timeout) {
  const int w = regions_.plan.shape().num_workers;
  uint64_t* beats = heap_.DirectAs<uint64_t>(0, regions_.heartbeats);
  if (beats == nullptr || heap_.backend() != shmem::HeapBackend::kShm) return -1;
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
    } else if (now - beat_seen_[i] > timeout) {
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
  deadline = std::min(deadline, absl::Now() + regions_.plan.timeout());
  BatchTrace trace;

  absl::Time t0 = absl::Now();
  absl::Status s = Scatter(chunks, total);
  if (!s.ok()) return Fail(s.ToString());
  trace.scatter_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);

  s = Post(BatchOp::kRun, layer_pos, total, deadline);
  if (!s.ok()) return Fail(s.ToString());
  s = WaitDone(deadline);
  if (!s.ok()) return FailBatch(s);
  EPSERVE_RETURN_IF_ERROR(CollectReports(trace));

  t0 = absl::Now();
  Gather(chunks);
  trace.gather_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);
  return trace;
}

absl::Status Coordinator::Scatter(std::span<const RowChunk> chunks, int64_t total) {
  const ExchangeShape& shape = regions_.plan.shape();
  const int num_workers = shape.num_workers;
  const size_t row_bytes = static_cast<size_t>(shape.hidden) * sizeof(float);
  // Batch row r goes to worker w with begin(w) <= r < end(w).
  int64_t row = 0;
  int w = 0;
  for (const RowChunk& c : chunks) {
    for (int64_t done = 0; done < c.rows;) {
      while (row >= RowSplit(total, w + 1, num_workers)) ++w;
      const int64_t begin = RowSplit(total, w, num_workers);
      const int64_t end = RowSplit(total, w + 1, num_workers);
      const int64_t take = std::min(c.rows - done, end - row);
      EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w), regions_.input + (row - begin) * row_bytes,
                                        c.input + done * shape.hidden, take * row_bytes));
      row += take;
      done += take;
    }
  }
  return absl::OkStatus();
}

absl::Status Coordinator::FailBatch(const absl::Status& wait) {
  if (absl::IsCancelled(wait)) {
    healthy_ = false;
    return wait;
  }
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.reports);
  std::string why = std::string(wait.message());
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (heap_.SignalLoad(HeapRegions::Signal(regions_.done_seq, w)) < seq_) {
      absl::StrAppend(&why, "; worker ", w, " (rank ", RankOfWorker(w), ") did not finish");
    } else if (reports[w].status_code != 0) {
      absl::StrAppend(&why, "; ", ReportMessage(reports[w]));
    }
  }
  return Fail(why);
}

absl::Status Coordinator::CollectReports(BatchTrace& trace) {
  const ExchangeShape& shape = regions_.plan.shape();
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.reports);
  trace.stage_ns.resize(shape.num_workers);
  const size_t dispatch_row_bytes = regions_.plan.dispatch_row_bytes();
  const size_t combine_row_bytes = regions_.plan.combine_row_bytes();
  std::string timeouts;
  absl::Status first_error;
  for (int w = 0; w < shape.num_workers; ++w) {
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
  for (int w = 0; w < shape.num_workers; ++w) {
    for (int e = 0; e < shape.num_experts; ++e) {
      const int64_t pairs = expert_tokens[static_cast<size_t>(w) * shape.num_experts + e];
      trace.expert_tokens[e] += pairs;
      trace.worker_pairs[w] += pairs;
    }
  }
  return absl::OkStatus();
}

void Coordinator::Gather(std::span<const RowChunk> chunks) {
  const ExchangeShape& shape = regions_.plan.shape();
  const size_t row_bytes = static_cast<size_t>(shape.hidden) * sizeof(float);
  const size_t k = static_cast<size_t>(shape.top_k);
  const float* out = heap_.LocalAs<float>(regions_.output);
  const int32_t* ids = heap_.LocalAs<int32_t>(regions_.topk_ids);
  const float* weights = heap_.LocalAs<float>(regions_.topk_weights);
  for (const RowChunk& c : chunks) {
    std::memcpy(c.output, out, c.rows * row_bytes);
    out += c.rows * shape.hidden;
    if (c.topk_ids != nullptr) std::memcpy(c.topk_ids, ids, c.rows * k * sizeof(int32_t));
    if (c.topk_weights != nullptr) std::memcpy(c.topk_weights, weights, c.rows * k * sizeof(float));
    ids += c.rows * k;
    weights += c.rows * k;
  }
}

absl::Status Coordinator::Control(BatchOp op, absl::Time deadline) {
  absl::Status s = Post(op, 0, 0, deadline);
  if (s.ok()) s = WaitDone(deadline);
  if (!s.ok()) return Fail(s.ToString());
  const WorkerReport* reports = heap_.LocalAs<WorkerReport>(regions_.reports);
  for (int i = 0; i < regions_.plan.shape().num_workers; ++i) {
    if (reports[i].status_code != 0) return ReportStatus(reports[i]);
  }
  return absl::OkStatus();
}

absl::Status Coordinator::BeginStage(const std::string& model, uint64_t seed, absl::Time deadline,
                                     const std::vector<ExpertPlacement>* placements) {
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
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    absl::Status s = heap_.Put(RankOfWorker(w), regions_.control, &message, sizeof(message));
    // The table goes where the worker's next batch rows would: the worker copies it out when
    // it takes the kStage, before any later batch.
    if (s.ok() && !table.empty()) {
      s = heap_.Put(RankOfWorker(w), regions_.input, table.data(), table.size() * sizeof(int32_t));
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
  bool all = true;
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
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
  int64_t bytes = 0;
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) bytes += reports[w].weight_bytes;
  return bytes;
}

absl::Status Coordinator::EndStage(bool use_new, absl::Time deadline) {
  stage_seq_ = 0;
  absl::Status s = Control(use_new ? BatchOp::kSwitch : BatchOp::kDiscard, deadline);
  if (use_new && s.ok() && !staged_placements_.empty()) placements_.swap(staged_placements_);
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
  // Workers still finishing an aborted batch see the stop right after it.
  abort_.store(false);
  absl::Status s = Post(BatchOp::kStop, 0, 0, deadline);
  if (s.ok()) s = WaitDone(deadline);
  return s;
}

}  // namespace epserve::worker
