// Rank 0's coordinator: a batch's life cycle (start, rows placed and scattered, posted,
// completed, gathered; slices and the retry after a worker's death). Its signals to the
// workers and the control steps are in coordinator_signals.cc, a worker's death in
// coordinator_deaths.cc.
#include "worker/coordinator.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "worker/placement.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"

namespace epserve::worker {
namespace {

// Rows in clients' system shared memory as rank 0 copies them: by the addresses the chunks
// hold beside (RowChunk::device_input / device_output).
void LeaveShmRowsToRank0(std::vector<RowChunk>& chunks) {
  for (RowChunk& c : chunks) {
    if (c.device_input.in_host_shm()) c.device_input = {};
    if (c.device_output.in_host_shm()) c.device_output = {};
  }
}

// The rows of `chunks` that the workers read from clients' memory themselves.
int64_t ClientRows(std::span<const RowChunk> chunks) {
  int64_t rows = 0;
  for (const RowChunk& c : chunks) rows += c.device_input.valid() ? c.rows : 0;
  return rows;
}

}  // namespace

Coordinator::Coordinator(shmem::SymmetricHeap& heap, const HeapRegions& regions,
                         std::vector<ExpertPlacement> placements)
    : heap_(heap),
      regions_(regions),
      placements_(std::move(placements)),
      serving_live_(WorkerSet::All(regions.plan.shape().num_workers)),
      live_(serving_live_) {}

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
  bool cuda = false;  // some rows in clients' CUDA memory
  for (const RowChunk& c : chunks) {
    total += c.rows;
    for (const DeviceRows* d : {&c.device_input, &c.device_output}) {
      cuda = cuda || (d->valid() && !d->in_host_shm());
    }
  }
  if (total < 1 || total > shape.max_batch_tokens) {
    return absl::InternalError(
        absl::StrCat("batch of ", total, " rows outside [1, ", shape.max_batch_tokens, "]"));
  }
  // Refused before any worker sees it: one worker failing alone would leave its peers
  // waiting for it in the exchange.
  if (cuda && !workers_read_cuda_) {
    return absl::FailedPreconditionError(
        "rows in CUDA shared memory, which not every worker can reach (their devices are not "
        "CUDA GPUs)");
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
  // The workers run one batch at a time: post now only when none is in flight.
  const bool busy = std::any_of(flight_.begin(), flight_.end(), [](const InFlight& f) {
    return f.state != InFlight::State::kDone;
  });
  // Rows in clients' system shared memory: the workers take them where they are idle (nothing
  // would overlap rank 0's copies, which would come on top of the batch's time); a batch that
  // waits for the one before has its rows copied by rank 0 meanwhile, and its output copied
  // out while the workers compute the next, as for other rows (the chunks hold the rows'
  // addresses in rank 0's mapping too).
  if (busy || !workers_read_shm_) LeaveShmRowsToRank0(b.chunks);
  const bool device_input = std::any_of(b.chunks.begin(), b.chunks.end(),
                                        [](const RowChunk& c) { return c.device_input.valid(); });
  if (absl::Status s = PlaceRows(b); !s.ok()) return s;
  if (!b.slices) {
    absl::Status s = Scatter(b.chunks, b.total, b.live, b.slot);
    if (!s.ok()) return Fail(s.ToString());
    b.trace.scatter_ns = absl::ToInt64Nanoseconds(absl::Now() - b.start);
    b.trace.client_rows = ClientRows(b.chunks);
  }
  if (busy && !b.slices && !device_input) {
    // The workers may upload these rows while they compute the batch before (not where some
    // are in CUDA memory: the workers take only the others from the heap).
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

// GCC 12, inlining Complete here, reports the moved StatusOr's BatchTrace as maybe
// uninitialized on the paths where it holds an error (a false positive).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
absl::StatusOr<BatchTrace> Coordinator::Finish(uint64_t ticket) {
  if (flight_.empty() || flight_.front().ticket != ticket) {
    return absl::InternalError(absl::StrCat("Finish(", ticket, ") out of the order of Start"));
  }
  Complete(flight_.front());
  absl::StatusOr<BatchTrace> result = std::move(flight_.front().result);
  flight_.pop_front();
  return result;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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
      if (c.input != nullptr) {
        part.input =
            static_cast<const char*>(c.input) + skip * hidden * common::ElementBytes(c.input_type);
      }
      if (c.output != nullptr) {
        part.output =
            static_cast<char*>(c.output) + skip * hidden * common::ElementBytes(c.output_type);
      }
      if (c.device_input.valid()) part.device_input = c.device_input.Advanced(skip, hidden);
      if (c.device_output.valid()) part.device_output = c.device_output.Advanced(skip, hidden);
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
  all.client_rows += part.client_rows;
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
  trace.client_rows = ClientRows(chunks);

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
  for (std::vector<DeviceRowSegment>& t : device_rows_) t.clear();
  device_rows_.resize(num_workers);
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
      if (c.device_output.valid()) {
        device_rows_[w].push_back(
            {row - begin, take, 1, 0, c.device_output.Advanced(done, shape.hidden)});
      }
      if (c.device_input.valid()) {  // the worker reads these rows itself
        device_rows_[w].push_back(
            {row - begin, take, 0, 0, c.device_input.Advanced(done, shape.hidden)});
        row += take;
        done += take;
        continue;
      }
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
  return PutDeviceRowTables(live, slot);
}

absl::Status Coordinator::PutDeviceRowTables(const WorkerSet& live, int slot) {
  for (int w = 0; w < regions_.plan.shape().num_workers; ++w) {
    if (!live.Has(w)) continue;
    const std::vector<DeviceRowSegment>& segments = device_rows_[w];
    const int64_t header[2] = {static_cast<int64_t>(segments.size()), 0};
    const size_t at = regions_.DeviceRowTables(slot);
    EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w), at, header, sizeof(header)));
    if (!segments.empty()) {
      EPSERVE_RETURN_IF_ERROR(heap_.Put(RankOfWorker(w), at + DeviceRowTable::kSegmentsAt,
                                        segments.data(),
                                        segments.size() * sizeof(DeviceRowSegment)));
    }
    // The Puts read `header` and device_rows_, which the next Scatter reuses.
    EPSERVE_RETURN_IF_ERROR(heap_.Flush(RankOfWorker(w)));
  }
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
      absl::StrAppend(&why, "; ", reports[w].Message());
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
        absl::StrAppend(&timeouts, timeouts.empty() ? "" : "; ", report.Message());
      } else if (first_error.ok()) {
        first_error = report.ToStatus();
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
    if (!c.device_output.valid()) {  // else the workers wrote the rows into the client's memory
      copies_.push_back({c.output, c.output_type, out, common::ElementType::kFp32,
                         static_cast<size_t>(c.rows * shape.hidden)});
    }
    out += c.rows * shape.hidden;
    if (c.topk_ids != nullptr) std::memcpy(c.topk_ids, ids, c.rows * k * sizeof(int32_t));
    if (c.topk_weights != nullptr) std::memcpy(c.topk_weights, weights, c.rows * k * sizeof(float));
    ids += c.rows * k;
    weights += c.rows * k;
  }
  common::ParallelConvert(copy_threads_, copies_);
}

}  // namespace epserve::worker
