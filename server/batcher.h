// The dynamic batcher: packs queued requests of one layer into batches of at most
// max_batch_tokens rows (splitting requests larger than that), waiting at most
// max_queue_delay for more rows, highest priority first, and runs each batch through an
// executor. Three threads form a pipeline so that rank 0 is never idle between batches:
//
//   formation   picks the pieces of the next batch and converts BF16/FP16 inputs into an
//               FP32 staging buffer, while the executor runs the current batch;
//   executor    runs one batch at a time (the coordinator is single-threaded);
//   completion  converts outputs back to the requested datatype and answers requests.
//
// At most one formed batch waits for the executor, and while it waits it keeps taking in
// rows of its layer as they arrive, up to max_batch_tokens: under load every batch holds what
// arrived while the previous one ran, and an idle executor gets a batch without delay.
//
// A small request that finds the pipeline idle skips the hand-offs (direct_batch_tokens): the
// thread that enqueues it starts its batch, and the executor answers it when the completion
// thread has nothing to do. Each hand-off wakes a sleeping thread, which on an idle host
// takes tens of microseconds, as long as a decode-sized batch's copies.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/dtype.h"
#include "server/served_model.h"
#include "worker/coordinator.h"

namespace epserve::server {

// Where one request's time went, as Triton's statistics report it. A request split over
// several batches is charged each batch's time.
struct TaskTimes {
  absl::Duration queue;           // accepted until its first rows went to the executor
  absl::Duration compute_input;   // rank 0 converting its batches' inputs
  absl::Duration compute_infer;   // its batches' runs through the workers
  absl::Duration compute_output;  // rank 0 converting its batches' outputs
};

// One accepted request. The fields above "batcher internals" are set by the caller before
// Enqueue and not changed afterwards.
struct InferTask {
  int layer_pos = 0;
  int64_t num_tokens = 0;
  uint32_t priority = 1;        // 1 is served first; at most the Batcher's priority_levels
  const char* input = nullptr;  // num_tokens * H elements of input_type, maybe unaligned
  common::ElementType input_type = common::ElementType::kFp32;
  char* output = nullptr;  // num_tokens * H elements of output_type
  common::ElementType output_type = common::ElementType::kFp32;
  // Or rows in a client's CUDA memory (input or output null): the workers read and write
  // them there (worker::RowChunk::device_input / device_output); valid() when set.
  worker::DeviceRows device_input{}, device_output{};
  // Optional routing outputs, num_tokens * k each, owned like `output`.
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
  // Holds the layer's output when the request does not ask for it (only for the routing).
  std::string unrequested_output;
  absl::Time enqueued;
  absl::Time deadline = absl::InfiniteFuture();
  // May be empty; called from the batcher's threads (or, for a request started directly,
  // from the thread that enqueued it).
  std::function<bool()> cancelled;
  // Called exactly once, from one of the batcher's threads, after the batcher's last use of
  // input and output.
  std::function<void(absl::Status, const TaskTimes&)> done;

  // ---- batcher internals ----
  // Formation thread only (or the enqueuing thread's, for a request started directly).
  int64_t rows_taken = 0;
  // When its first rows went to the executor; as rows_taken.
  absl::Time first_batched = absl::InfiniteFuture();
  std::atomic<bool> failed{false};  // an error was recorded; remaining rows are dropped
  std::atomic<int> refs{1};         // the queue's reference + one per piece in flight
  std::mutex mu;
  absl::Status status;  // guarded by mu; the first error wins
  TaskTimes times;      // completion thread only until refs drops to 0
};

// The batching settings, each bound to its flag. FrontEndOptions::batching is their home;
// the Batcher keeps a copy of the whole struct, and the service reports it (ModelConfig).
struct BatchingOptions {
  int64_t max_batch_tokens = 256;    // --max-batch-tokens: most rows in one batch
  int64_t max_queue_delay_us = 0;    // --max-queue-delay-us: longest wait for more rows
  int64_t max_queue_tokens = 65536;  // --max-queue-tokens: most rows queued
  int copy_threads = 1;              // threads of a batch's dtype conversions (--host-copy-threads)
  // Threads that hand finished requests' answers to gRPC (which serialises each one there: a
  // 4096-token answer takes milliseconds), so that the completion thread goes on with the
  // next batch meanwhile; 0 or 1: the completion thread answers itself.
  int respond_threads = 0;
  // A request of at most this many rows (and of one batch) that finds the pipeline idle (the
  // executor waiting, nothing queued or formed) is started as a batch of its own by the thread
  // that enqueues it, with a PipelinedExecutor: its rows' copy into the heap and the workers'
  // signal are made there, and the executor, woken meanwhile, waits for its end; the executor
  // also answers a batch of at most this many rows where the completion thread is idle, and
  // such answers are given without a responder thread. 0: never (--direct-batch-tokens).
  int64_t direct_batch_tokens = 128;
  // The longest the executor sleeps between two looks at a running batch's end, where 1/64 of
  // the batch's time so far is less: the end is noticed at most about this late.
  absl::Duration end_poll = absl::Microseconds(50);
  // The executor takes each request's rows in the request's own element types
  // (RowChunk::input_type / output_type) and converts them as it copies them (the
  // coordinator: into and out of the heap); false: the batcher hands it FP32 rows, converting
  // BF16 and FP16 ones on its formation and completion threads.
  bool executor_converts = false;

  absl::Duration max_queue_delay() const { return absl::Microseconds(max_queue_delay_us); }
  // INVALID_ARGUMENT naming the flag and its bound.
  absl::Status Validate() const;
};

// Thread-safe: Enqueue and Stop from any thread.
class Batcher {
 public:
  // Runs one batch; called only from the executor thread, one batch at a time.
  using Executor =
      std::function<absl::Status(int layer_pos, std::span<const worker::RowChunk> chunks)>;

  // Runs batches two at a time (worker::Coordinator::Start / Finish): `start` begins a batch
  // and returns a ticket, possibly while the batch started before it has not finished (its
  // rows are copied in while the workers compute that one); `finish` ends the batch of a
  // ticket, in the order of the starts. `finished` (optional) says without waiting whether
  // `finish` of the oldest running batch would return at once; with it the executor starts
  // the next batch whenever it is formed while one runs, else only if it is formed right
  // when the running one starts. All are called only from the executor thread.
  struct PipelinedExecutor {
    std::function<absl::StatusOr<uint64_t>(int layer_pos, std::span<const worker::RowChunk> chunks)>
        start;
    std::function<absl::Status(uint64_t ticket, int layer_pos,
                               std::span<const worker::RowChunk> chunks)>
        finish;
    std::function<bool(uint64_t ticket)> finished;
  };

  // Told of every batch the executor ran successfully, after its requests were answered:
  // its rows and where its time went (input conversion, the executor, output conversion,
  // and the whole completion: output conversion plus answering). Called from the
  // completion thread, or the executor's for a batch it answers itself; never from both at
  // once.
  using BatchObserver = std::function<void(int64_t rows, absl::Duration input, absl::Duration infer,
                                           absl::Duration output, absl::Duration respond)>;

  // Told of rows taken out before they were computed (the request cancelled, past its
  // deadline, or failed), with the code they were failed with. Called from the batcher's
  // threads.
  using SkipObserver = std::function<void(absl::StatusCode code, int64_t rows)>;

  // Copies `options` and `model` whole (hidden size, served layers, top-k). Requests take
  // priorities 1..priority_levels (RequestOptions::priority_levels), one queue each.
  // `observer` and `on_rows_skipped` may be empty.
  Batcher(const BatchingOptions& options, const ServedModel& model, int64_t priority_levels,
          Executor executor, BatchObserver observer = nullptr,
          SkipObserver on_rows_skipped = nullptr);
  // The same with two batches in flight: a batch starts while the one before it finishes.
  Batcher(const BatchingOptions& options, const ServedModel& model, int64_t priority_levels,
          PipelinedExecutor executor, BatchObserver observer = nullptr,
          SkipObserver on_rows_skipped = nullptr);
  ~Batcher();  // Stop(), then joins.

  // On OK the batcher owns the task and will call task->done. On error (RESOURCE_EXHAUSTED
  // when the queue is full, UNAVAILABLE when stopped, INVALID_ARGUMENT for a layer or
  // priority out of range) the caller keeps it; done is not called.
  absl::Status Enqueue(std::shared_ptr<InferTask> task);

  // Stops accepting; fails queued tasks with UNAVAILABLE; lets formed batches run, answers
  // them and joins the threads. Idempotent.
  void Stop();

  int64_t queued_tokens() const;
  const BatchingOptions& options() const { return options_; }

  // Runs `fn` on the formation thread at a point where the executor is idle and no request
  // has had some of its rows computed but not all: requests begun are finished first (new
  // ones wait in the queue meanwhile), so every answer comes from one side of `fn` (a weight
  // swap). Blocks until `fn` has run and returns its status; UNAVAILABLE when stopping.
  // Concurrent calls run one after the other.
  absl::Status RunBetweenRequests(std::function<absl::Status()> fn);

 private:
  struct Piece {
    std::shared_ptr<InferTask> task;
    int64_t row = 0;  // first row of the task in this batch
    int64_t rows = 0;
    int64_t at = 0;        // first row of the piece in the batch
    bool skipped = false;  // left out before the run (cancelled, expired, failed)
  };
  struct Batch {
    int layer_pos = 0;
    int64_t rows = 0;  // of all pieces
    std::vector<Piece> pieces;
    std::vector<worker::RowChunk> chunks;
    std::vector<float> input_staging;   // max_batch_tokens * H, for non-FP32 inputs
    std::vector<float> output_staging;  // max_batch_tokens * H, for non-FP32 outputs
    absl::Duration input_time, infer_time, output_time;
    absl::Status status;
    uint64_t ticket = 0;  // PipelinedExecutor's
    absl::Time started;   // when the executor took it
    // Started by the thread that enqueued its one request (direct_batch_tokens): the
    // executor takes it running (or failed: status), and starts nothing.
    bool direct = false;
  };
  // A bounded FIFO between two threads of the pipeline.
  class Channel {
   public:
    explicit Channel(size_t capacity) : capacity_(capacity) {}
    void Push(Batch* b);
    Batch* Pop();  // nullptr once closed and empty
    // The next batch if one comes within `timeout` (zero: is there); nullptr otherwise.
    Batch* PopFor(absl::Duration timeout);
    void WaitNotFull();
    void Close();
    bool closed();

   private:
    const size_t capacity_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Batch*> items_;
    bool closed_ = false;
  };

  void FormLoop();
  // With a barrier pending and no request partly taken: waits for the executor to be idle,
  // runs the barrier's function (mu_ released meanwhile) and wakes its caller. Holds `lock`.
  void MaybeRunBarrier(std::unique_lock<std::mutex>& lock);
  // A queued request some of whose rows are taken but not all; nullptr if none. Holds mu_.
  const InferTask* PartlyTaken() const;
  // Whether `task` may start as a batch of its own on the enqueuing thread, now. Holds mu_.
  bool MayStartDirectly(const InferTask& task) const;
  // Starts `task` as batch `b` on this thread and hands the batch, running, to the executor.
  void StartDirectly(Batch* b, std::shared_ptr<InferTask> task);
  void ExecuteLoop();
  // ExecuteLoop with a PipelinedExecutor: while a batch runs, the next one formed is started
  // (its rows go in) before the running one is finished.
  void ExecutePipelined();
  // While `running` runs: the next formed batch as soon as there is one, or nullptr once
  // `running` has finished (at once where the executor has no `finished`), polling it with
  // a backoff like the coordinator's own wait for the workers.
  Batch* NextOrFinished(const Batch& running);
  // Sets b->chunks from its pieces, leaving out (and failing) rows no longer wanted, and
  // resets what the executor fills in (status, infer_time; started = now).
  void PrepareChunks(Batch* b);
  void CompleteLoop();
  // The executor's hand-over of an ended batch: answered on this thread where it is small
  // and the completion thread is idle (so answers stay in order), else by the completion
  // thread.
  void Complete(Batch* b);
  // Converts a finished batch's outputs, answers its requests and frees it.
  void CompleteBatch(Batch* b);
  // The completion thread's release of a task: its answer on a responder thread where there
  // are any (respond_threads), else here.
  void ReleaseToRespond(const std::shared_ptr<InferTask>& task);
  void RespondLoop();
  // The constructors' (one of the executors set): starts the threads.
  Batcher(const BatchingOptions& options, const ServedModel& model, int64_t priority_levels,
          Executor executor, PipelinedExecutor pipelined, BatchObserver observer,
          SkipObserver on_rows_skipped);
  // Waits until the queue's head may start a batch (a full batch of its layer is queued or
  // the head has waited max_queue_delay), then takes the batch's first pieces; false when
  // stopping. Holds `lock`. Tasks whose queue reference must be dropped (after unlocking) go
  // to `to_release`.
  bool TakePieces(std::unique_lock<std::mutex>& lock, Batch& batch,
                  std::vector<std::shared_ptr<InferTask>>& to_release);
  // Appends queued rows of batch.layer_pos to the batch, highest priority first, up to
  // max_batch_tokens, without waiting. Holds mu_.
  void AppendPieces(Batch& batch, std::vector<std::shared_ptr<InferTask>>& to_release);
  // Converts the non-FP32 inputs of pieces [first, end) into the batch's staging buffers.
  void StageInputs(Batch& batch, size_t first);
  void Fail(InferTask& task, absl::Status status);
  void Release(InferTask& task);  // drops one reference; the last one answers
  void Answer(InferTask& task);   // calls task.done, once its last reference is gone
  static absl::Status Dropped(InferTask& task, absl::Time now);

  // The fewest rows a thread converts: below this a thread's start costs more than it saves.
  static constexpr int64_t kRowsPerThread = 128;

  const BatchingOptions options_;
  const ServedModel model_;
  const Executor executor_;
  const PipelinedExecutor pipelined_;
  const BatchObserver observer_;
  const SkipObserver on_rows_skipped_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Per priority level (index 0 is level 1), FIFO.
  std::vector<std::deque<std::shared_ptr<InferTask>>> queues_;  // guarded by mu_
  std::vector<int64_t> queued_rows_;                            // per layer, guarded by mu_
  int64_t queued_tokens_ = 0;                                   // guarded by mu_
  bool stopping_ = false;                                       // guarded by mu_
  // The executor waits for a batch and none has been handed to it since: the formed batch
  // goes now instead of taking in more rows. Set only by the executor, right before it waits
  // (so never while a handed-over batch is pending), cleared by the formation thread as it
  // hands one over. Guarded by mu_.
  bool executor_idle_ = false;
  // The formation thread holds pieces not yet handed over: a request started directly would
  // overtake them. Guarded by mu_.
  bool forming_ = false;
  // A request is being started directly (claimed, not yet handed to the executor): the
  // formation thread closes the executor's channel only after it. Guarded by mu_.
  bool starting_directly_ = false;
  // Batches handed to the completion thread and not yet answered.
  std::atomic<int> completions_pending_{0};
  // RunBetweenRequests: the function waiting to run (null: none), and its result.
  std::function<absl::Status()> barrier_fn_;  // guarded by mu_
  uint64_t barriers_run_ = 0;                 // guarded by mu_
  bool barrier_running_ = false;              // guarded by mu_
  absl::Status barrier_status_;               // guarded by mu_
  std::condition_variable barrier_cv_;
  std::mutex barrier_call_mu_;  // one RunBetweenRequests at a time
  std::vector<std::unique_ptr<Batch>> batches_;
  // One batch forming, two handed over, two in the executor, and the completion's.
  static constexpr int kBatches = 6;
  Channel free_{kBatches};
  // Formed batches for the executor: a batch waits in formation, taking in rows, until the
  // executor is idle, except a full one for a pipelined executor, which goes at once; two of
  // those may wait, so that the next one is there when the executor starts a batch.
  Channel ready_{2};
  Channel finished_{4};
  std::once_flag stop_once_;
  std::thread form_thread_, execute_thread_, complete_thread_;
  // The responders (respond_threads) and the tasks whose answers they give, in order.
  std::vector<std::thread> responders_;
  std::mutex respond_mu_;
  std::condition_variable respond_cv_;
  std::deque<std::shared_ptr<InferTask>> to_respond_;  // guarded by respond_mu_
  bool respond_closed_ = false;                        // guarded by respond_mu_
};

}  // namespace epserve::server
