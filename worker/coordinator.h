// Rank 0's side of the exchange: scatters a batch's rows into the workers' input regions,
// starts the batch, waits for every worker and gathers the output rows.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "shmem/heap.h"
#include "worker/heap_regions.h"
#include "worker/placement.h"

namespace epserve::worker {

// What a finished batch reports, for metrics.
struct BatchTrace {
  int64_t scatter_ns = 0;
  int64_t gather_ns = 0;
  // stage_ns[w][stage] as worker w measured it.
  std::vector<std::array<int64_t, kNumWorkerStages>> stage_ns;
  std::vector<int64_t> expert_tokens;  // pairs routed to each expert (all its copies)
  std::vector<int64_t> worker_pairs;   // pairs each worker computed
  int64_t dispatch_bytes = 0;          // token rows stored into receivers, all workers
  int64_t combine_bytes = 0;           // expert output rows returned to owners, all workers
};

// A contiguous run of a batch's rows: `rows` rows read from `input` and answered into
// `output` (both [rows, H] floats, owned by the caller).
struct RowChunk {
  const float* input;
  float* output;
  int64_t rows;
  // Optional: where the routing of these rows goes, [rows, k] each (owned by the caller).
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
};

// Not thread-safe: one thread runs batches, one at a time.
class Coordinator {
 public:
  // `placements`: the workers' placement of each served layer (WorkerOptions::placements),
  // for metrics and tools; empty: contiguous.
  Coordinator(shmem::SymmetricHeap& heap, const HeapRegions& regions,
              std::vector<ExpertPlacement> placements = {})
      : heap_(heap), regions_(regions), placements_(std::move(placements)) {}

  // The serving placements, one per served layer; empty where none were given (contiguous).
  const std::vector<ExpertPlacement>& placements() const { return placements_; }

  // Waits until every worker has loaded its weights.
  absl::Status WaitForWorkers(absl::Time deadline);

  // Runs one batch of `layer_pos` over the rows of `chunks` (at most max_batch_tokens in all).
  // Every wait ends by `deadline`; the workers get a slightly earlier one, so that their
  // reports of which peer stopped taking part arrive first. When a worker or a peer did
  // not take part in time, the batch fails with UNAVAILABLE naming what happened (also
  // written to stderr), the exchange is in an unknown state and every later call fails
  // with UNAVAILABLE. RESOURCE_EXHAUSTED: the batch overflowed a receive capacity under
  // --recv-overflow=fail (no output rows were written; later batches run).
  absl::StatusOr<BatchTrace> Run(int layer_pos, std::span<const RowChunk> chunks,
                                 absl::Time deadline);

  // Replaces every worker's weights with those of `model` (as --model names it) and `seed`,
  // all at once, in three steps that each run between batches (from the thread that runs
  // them, or with it held off): BeginStage has every worker check the model and start
  // loading it beside the serving weights while batches go on; StageDone says when every
  // worker has loaded it (or the first worker's error); EndStage(true) makes the new weights
  // the serving ones on every worker and frees the old, EndStage(false) frees the new ones
  // (after any error: the old weights go on serving). A worker that does not answer by
  // `deadline` turns the exchange unhealthy (UNAVAILABLE). With `placements` (one per served
  // layer; a rebalance) the staged weights are laid out by them, and they serve from
  // EndStage(true) on; else the serving placements stay. INVALID_ARGUMENT where their table
  // does not fit a worker's input region.
  absl::Status BeginStage(const std::string& model, uint64_t seed, absl::Time deadline,
                          const std::vector<ExpertPlacement>* placements = nullptr);
  absl::StatusOr<bool> StageDone();
  // Once StageDone said true: the bytes of weights the workers loaded, all together.
  int64_t StagedBytes() const;
  absl::Status EndStage(bool use_new, absl::Time deadline);
  // The three steps in a row, polling StageDone every 10 ms (no batches run meanwhile).
  absl::Status SwapWeights(const std::string& model, uint64_t seed, absl::Time deadline);

  // Sends kStop to every worker and waits for them to acknowledge.
  absl::Status Stop(absl::Time deadline);

  // Makes a running or later Run return CANCELLED at once (shutdown). Thread-safe.
  void Abort() { abort_.store(true); }

  bool healthy() const { return healthy_.load(); }

  // Workers whose heartbeat (HeapRegions::heartbeats) has not advanced for `timeout`, as
  // of this call; -1 where the heap gives rank 0 no load/store view of its segment for the
  // workers to beat into (the rma backend: not monitored). Thread-safe, and independent of
  // Run: a stopped (SIGSTOP) or wedged worker shows here within `timeout` even while no
  // batch runs, or while one waits for it.
  int StalledWorkers(absl::Duration timeout);
  const ExchangeShape& shape() const { return regions_.plan.shape(); }

 private:
  absl::Status Post(BatchOp op, int layer_pos, int64_t total_rows, absl::Time deadline);
  absl::Status WaitDone(absl::Time deadline);
  // Posts a control op (no rows) and waits for every worker: the first error a worker
  // reports, or Fail when one does not answer.
  absl::Status Control(BatchOp op, absl::Time deadline);
  // Turns the exchange unhealthy and returns UNAVAILABLE explaining `why`.
  absl::Status Fail(absl::string_view why);
  // Run's steps. Scatter puts the rows of `chunks` (`total` in all) into the workers' input
  // regions, split by RowSplit. FailBatch answers a failed wait for the batch's end: CANCELLED
  // as it is (shutdown, the exchange turns unhealthy), else Fail naming each worker that did
  // not finish and each finished worker's error. CollectReports reads the workers' reports
  // into `trace`: Fail when any timed out, else the first other error as it is. Gather copies
  // the output rows and their routing out of rank 0's segment into `chunks`.
  absl::Status Scatter(std::span<const RowChunk> chunks, int64_t total);
  absl::Status FailBatch(const absl::Status& wait);
  absl::Status CollectReports(BatchTrace& trace);
  void Gather(std::span<const RowChunk> chunks);

  shmem::SymmetricHeap& heap_;
  const HeapRegions regions_;
  std::vector<ExpertPlacement> placements_;
  std::vector<ExpertPlacement> staged_placements_;  // of the stage under way, if it brings any
  uint64_t seq_ = 0;
  uint64_t stage_seq_ = 0;  // the kStage's seq of a weight swap under way; 0: none
  std::atomic<bool> healthy_{true};
  // StalledWorkers' view: each worker's last heartbeat and when it last changed.
  std::mutex beat_mu_;
  std::vector<uint64_t> last_beat_;    // guarded by beat_mu_
  std::vector<absl::Time> beat_seen_;  // guarded by beat_mu_
  std::atomic<bool> abort_{false};
};

}  // namespace epserve::worker
