// Rank 0's side of the exchange: scatters a batch's rows into the workers' input regions,
// starts the batch, waits for every worker and gathers the output rows.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/convert.h"
#include "common/element_type.h"
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
  WorkerSet workers;                   // the workers that took part (all but the dead); empty: all
  int64_t dispatch_bytes = 0;          // token rows stored into receivers, all workers
  int64_t combine_bytes = 0;           // expert output rows returned to owners, all workers
  // Rows the workers read from clients' memory themselves (RowChunk::device_input), which
  // rank 0 did not copy.
  int64_t client_rows = 0;
};

// A contiguous run of a batch's rows: `rows` rows read from `input` and answered into
// `output` ([rows, H] elements of input_type and output_type, owned by the caller). The heap
// holds FP32 rows: rank 0 converts BF16 and FP16 rows as it copies them in and out, so that a
// request's bytes are read once on the way in and its answer written once on the way out.
struct RowChunk {
  const void* input;
  void* output;
  int64_t rows;
  // Optional: where the routing of these rows goes, [rows, k] each (owned by the caller).
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
  common::ElementType input_type = common::ElementType::kFp32;   // FP32, BF16 or FP16
  common::ElementType output_type = common::ElementType::kFp32;  // FP32, BF16 or FP16
  // Rows in a client's memory instead: its CUDA memory (input null, or output null: the
  // workers read the rows from it, or write them into it; rank 0 never copies them), or its
  // system shared memory (input and output are rank 0's addresses of the same rows; Start
  // decides who moves them: the workers where workers_read_shm() and they are idle, else
  // rank 0). Their element types are these' own (input_type and output_type are not used for
  // them).
  DeviceRows device_input{}, device_output{};

  // The rows as FP32, for those whose types are FP32 (an executor that takes no other).
  const float* fp32_input() const { return static_cast<const float*>(input); }
  float* fp32_output() const { return static_cast<float*>(output); }
};

// Not thread-safe: one thread runs batches, one at a time.
class Coordinator {
 public:
  // `placements`: the workers' placement of each served layer (WorkerOptions::placements),
  // for metrics and tools; empty: contiguous.
  Coordinator(shmem::SymmetricHeap& heap, const HeapRegions& regions,
              std::vector<ExpertPlacement> placements = {});
  ~Coordinator();  // ends the watch of the workers' processes

  // The serving placements, one per served layer (after a worker's death: OnlyOn the
  // survivors); empty where none were given (contiguous).
  const std::vector<ExpertPlacement>& placements() const {
    return survivor_placements_.empty() ? placements_ : survivor_placements_;
  }

  // Waits until every worker has loaded its weights. On the shm heap (every worker on this
  // host) it then watches each worker's process (a pidfd per worker, from the pid it stored
  // in the heap) for the rest of the job: see "A worker's death" below.
  absl::Status WaitForWorkers(absl::Time deadline);
  // Once WaitForWorkers returned: whether every worker can read and write rows in clients'
  // CUDA memory (RowChunk::device_input / device_output), i.e. runs on a CUDA GPU with the
  // driver API (a worker's ready word says so: kReadyReadsCuda).
  bool workers_read_cuda() const { return workers_read_cuda_; }
  // Likewise for rows in clients' system shared memory (RowChunk::device_input / device_output
  // of DeviceRows::Kind::kHostShm): every worker is on this host and takes them itself
  // (--workers-read-shm; kReadyReadsShm).
  bool workers_read_shm() const { return workers_read_shm_; }

  // ---- A worker's death (shm heap; launched with `mpirun --enable-recovery`, so that the
  // MPI job outlives a rank) ----
  // The watch thread notices a worker's process end within milliseconds, counts it out of
  // the live workers and stores a new generation into every worker's `cancel` signal, which
  // ends the running batch's waits for the dead one at once (on rank 0 too). Where every
  // expert of every served layer still has a copy on a live worker (and the shared expert is
  // not split over the workers), Run waits for the survivors to give up the batch and runs
  // it again over the survivors when its deadline leaves time, then the service goes on with
  // them: a batch's rows are split over the live workers, each layer's placement OnlyOn them
  // (they hold those weights already). Otherwise, or on the rma heap, the death cannot be
  // served through: `on_fatal_death` runs (the server ends the MPI job there, as mpirun
  // would without --enable-recovery, so that its supervisor restarts it).
  void set_on_fatal_death(std::function<void(const std::string& why)> f) {
    on_fatal_death_ = std::move(f);
  }
  // The workers alive as far as the watch knows, and how many died. Thread-safe.
  WorkerSet live_workers() const;
  int lost_workers() const { return lost_.load(); }

  // Runs one batch of `layer_pos` over the rows of `chunks` (at most max_batch_tokens in all).
  // Every wait ends by `deadline`; the workers get a slightly earlier one, so that their
  // reports of which peer stopped taking part arrive first. When a worker or a peer did
  // not take part in time, the batch fails with UNAVAILABLE naming what happened (also
  // written to stderr), the exchange is in an unknown state and every later call fails
  // with UNAVAILABLE. RESOURCE_EXHAUSTED: the batch overflowed a receive capacity under
  // --recv-overflow=fail (no output rows were written; later batches run).
  absl::StatusOr<BatchTrace> Run(int layer_pos, std::span<const RowChunk> chunks,
                                 absl::Time deadline);

  // ---- Two batches in flight ----
  // Run in two halves, so that rank 0's copies overlap the workers' compute: Start copies a
  // batch's rows into the workers' free input slot (HeapRegions::kSlots) and posts it at once
  // when no batch is in flight, else leaves it for the Finish of the one in flight, which
  // waits for that batch, posts the next and only then copies the finished batch's output
  // out (the workers compute the next batch meanwhile). Start may be called while one batch
  // is in flight, not two; each Start gets one Finish, in the order of the Starts; the chunks
  // must stay valid until their Finish returns. Run(...) is Start then Finish. A batch that
  // needs slices (after a worker's death, more rows than the survivors hold) or whose first
  // attempt lost a worker runs as Run does, from its Finish. A control step (BeginStage,
  // EndStage, Stop) first finishes whatever is in flight; its Finish then returns that outcome.
  absl::StatusOr<uint64_t> Start(int layer_pos, std::span<const RowChunk> chunks,
                                 absl::Time deadline);
  absl::StatusOr<BatchTrace> Finish(uint64_t ticket);
  // Whether Finish(ticket) of the oldest batch in flight would return without waiting for
  // the workers: they all ended it, or it cannot end well any more (a death cancelled it,
  // Abort, its deadline passed), or it runs in slices from Finish (which waits in any case).
  // Does not wait; false for any ticket but the oldest's. How the caller of Start and Finish
  // starts the next batch as soon as it is formed while this one still runs.
  bool Finished(uint64_t ticket);

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

  // Live workers whose heartbeat (HeapRegions::heartbeats) has not advanced for `timeout`, as
  // of this call; -1 where the heap gives rank 0 no load/store view of its segment for the
  // workers to beat into (the rma backend: not monitored). Thread-safe, and independent of
  // Run: a stopped (SIGSTOP) or wedged worker shows here within `timeout` even while no
  // batch runs, or while one waits for it.
  int StalledWorkers(absl::Duration timeout);
  const ExchangeShape& shape() const { return regions_.plan.shape(); }

  // Threads that copy a batch's rows into the workers' input regions and its output rows out
  // of rank 0's segment (where the heap gives load/store access; common::ParallelConvert).
  void set_copy_threads(int threads) { copy_threads_ = std::max(threads, 1); }

 private:
  // Posts `op` to the workers of `live` (rows split over them), as generation `generation`,
  // reading and writing data slot `slot`.
  absl::Status Post(BatchOp op, int layer_pos, int64_t total_rows, absl::Time deadline,
                    const WorkerSet& live, uint64_t generation, int slot = 0, uint64_t copy_id = 0);
  // Tells each worker of `live` that its rows of a batch of `total` rows are in input slot
  // `slot` as copy `copy_id` (RowsAhead), so that it may upload them while it computes.
  absl::Status AnnounceRows(int64_t total, const WorkerSet& live, int slot, uint64_t copy_id);
  // A batch between Start and Finish.
  struct InFlight {
    enum class State { kScattered, kPosted, kDone };
    uint64_t ticket = 0;
    int layer_pos = 0;
    std::vector<RowChunk> chunks;
    int64_t total = 0;
    absl::Time deadline, start;
    int slot = 0;
    WorkerSet live;  // the workers its rows were split over
    uint64_t generation = 0;
    uint64_t copy_id = 0;  // its rows' copy as announced (RowsAhead); 0: not announced
    bool slices = false;   // runs as Run does (RunSlices), from Finish
    State state = State::kScattered;
    BatchTrace trace;                   // scatter_ns, until done
    absl::StatusOr<BatchTrace> result;  // kDone
  };
  // Where a batch's rows go now: its live set and generation, and whether they fit one pass
  // over them (else slices). An error where the live set cannot serve.
  absl::Status PlaceRows(InFlight& b);
  // Posts b (kScattered, its predecessor done), first copying its rows again where the live
  // set changed since; b ends kPosted, or kDone with an error, or marked for slices.
  void PostPending(InFlight& b);
  // Makes b (the oldest in flight) kDone: waits for it (posting its successor as soon as the
  // workers are free) and gathers its output, or runs it in slices.
  void Complete(InFlight& b);
  // Whether worker w has reported the last posted batch (or control step) done.
  bool EndedPosted(int w);
  // Completes every batch in flight (before a control step).
  void Drain();
  std::deque<InFlight> flight_;
  uint64_t next_ticket_ = 1;
  int next_slot_ = 0;
  // Waits for the end of the posted batch on every worker of `workers`. CANCELLED when Abort
  // was called, or when a worker died after the batch's `generation` was taken.
  absl::Status WaitDone(absl::Time deadline, const WorkerSet& workers, uint64_t generation);
  // After a death cancelled the batch posted to `posted`: waits until each of its workers
  // still alive has left it (they no longer touch the heap for it). FailBatch's error when
  // one does not in time.
  absl::Status WaitForSurvivors(absl::Time deadline, const WorkerSet& posted);
  // Makes `live` the serving set (survivor_placements_ OnlyOn it) if it is not yet; an error
  // (the exchange turns unhealthy) where an expert has no copy left.
  absl::Status UseLiveWorkers(const WorkerSet& live);
  // The watch thread's body, and what it does when worker w's process has ended.
  void Watch(std::vector<int> pidfds, std::vector<int64_t> pids);
  void OnDeath(int w, int64_t pid);
  // The serving placements OnlyOn `live`, where they (and the exchange) can serve without the
  // workers outside it; UNAVAILABLE with the reason where not.
  absl::StatusOr<std::vector<ExpertPlacement>> SurvivorPlacements(const WorkerSet& live) const;
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
  absl::Status Scatter(std::span<const RowChunk> chunks, int64_t total, const WorkerSet& live,
                       int slot);
  // Scatter's last step: each live worker's DeviceRowTable of slot `slot` (device_rows_).
  absl::Status PutDeviceRowTables(const WorkerSet& live, int slot);
  absl::Status FailBatch(const absl::Status& wait, const WorkerSet& posted);
  absl::Status CollectReports(BatchTrace& trace, const WorkerSet& posted);
  // Rows [begin, begin + rows) of the batch `chunks`, as chunks of their own, into `out`.
  void Slice(std::span<const RowChunk> chunks, int64_t begin, int64_t rows,
             std::vector<RowChunk>& out) const;
  // Adds a slice's trace to the batch's.
  static void Accumulate(BatchTrace& all, const BatchTrace& part);
  // One attempt of Run over `live` as `generation`; CANCELLED with `died` set when a worker
  // died under it (every survivor has then left it).
  absl::StatusOr<BatchTrace> RunOnce(int layer_pos, std::span<const RowChunk> chunks, int64_t total,
                                     absl::Time deadline, const WorkerSet& live,
                                     uint64_t generation, bool& died, int slot);
  // Run's way: the batch in slices that fit the live workers, each run again once over the
  // survivors where a worker died under it (`retried`: the batch's one retry is spent;
  // `started`: when the batch began, for the retry's deadline check).
  absl::StatusOr<BatchTrace> RunSlices(int layer_pos, std::span<const RowChunk> chunks,
                                       int64_t total, absl::Time deadline, absl::Time started,
                                       int slot, bool retried);
  // Most rows of a batch one pass over `live` holds (its slices' size).
  int64_t RowsThatFit(const WorkerSet& live) const;
  // Whether a batch whose attempt a death cancelled may run again over the survivors.
  bool MayRetry(absl::Time deadline, absl::Time started);
  void Gather(std::span<const RowChunk> chunks, int slot);

  shmem::SymmetricHeap& heap_;
  const HeapRegions regions_;
  std::vector<ExpertPlacement> placements_;
  int copy_threads_ = 1;
  std::vector<common::ConvertJob> copies_;                  // Scatter's and Gather's, reused
  std::vector<float> put_rows_;                             // Scatter's converted rows for a Put
  std::vector<std::vector<DeviceRowSegment>> device_rows_;  // Scatter's, per worker, reused
  bool workers_read_cuda_ = false;                          // WaitForWorkers's finding
  bool workers_read_shm_ = false;                           // WaitForWorkers's finding
  std::vector<ExpertPlacement> staged_placements_;  // of the stage under way, if it brings any
  // The live set batches run over, and placements_ OnlyOn it (empty while all live).
  WorkerSet serving_live_;
  std::vector<ExpertPlacement> survivor_placements_;
  // The watch: the workers alive (guarded by live_mu_), how many died, and the generation:
  // the deaths noticed so far, stored (SignalStore) into cancel_word_ and every worker's
  // `cancel` signal.
  mutable std::mutex live_mu_;
  WorkerSet live_;
  std::atomic<int> lost_{0};
  uint64_t cancel_word_ = 0;
  std::function<void(const std::string&)> on_fatal_death_;
  std::thread watch_;
  int watch_stop_fd_ = -1;  // an eventfd: written to end the watch
  uint64_t seq_ = 0;
  uint64_t copies_announced_ = 0;  // the last RowsAhead::copy_id
  uint64_t stage_seq_ = 0;         // the kStage's seq of a weight swap under way; 0: none
  std::atomic<bool> healthy_{true};
  // StalledWorkers' view: each worker's last heartbeat and when it last changed.
  std::mutex beat_mu_;
  std::vector<uint64_t> last_beat_;    // guarded by beat_mu_
  std::vector<absl::Time> beat_seen_;  // guarded by beat_mu_
  std::atomic<bool> abort_{false};
};

}  // namespace epserve::worker
