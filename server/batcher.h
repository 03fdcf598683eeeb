// The dynamic batcher: packs queued requests of one layer into batches of at most
// max_batch_tokens rows (splitting requests larger than that), waiting at most
// max_queue_delay for more rows, and runs each batch through an executor.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/coordinator.h"

namespace epserve::server {

// One accepted request. The batcher calls `done` exactly once, from its own thread.
struct InferTask {
  int layer_pos = 0;
  int64_t num_tokens = 0;
  const char* input = nullptr;  // num_tokens * H floats, owned by the caller until done
  char* output = nullptr;       // num_tokens * H floats, owned by the caller until done
  absl::Time enqueued;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
  std::function<void(absl::Status, absl::Duration queue_time)> done;
  // Batcher thread only.
  int64_t rows_taken = 0;
  bool failed = false;
  absl::Time first_batched = absl::InfiniteFuture();
};

struct BatcherOptions {
  int64_t max_batch_tokens = 256;
  absl::Duration max_queue_delay = absl::Microseconds(500);
  int64_t max_queue_tokens = 65536;
  int64_t hidden_size = 0;
};

// Thread-safe: Enqueue from any thread; one internal thread forms and runs batches.
class Batcher {
 public:
  // Runs one batch; called only from the batcher thread, one batch at a time.
  using Executor =
      std::function<absl::Status(int layer_pos, std::span<const worker::RowChunk> chunks)>;

  Batcher(BatcherOptions options, Executor executor);
  ~Batcher();  // Stop(), then joins.

  // On OK the batcher owns the task and will call task->done. On error (RESOURCE_EXHAUSTED
  // when the queue is full, UNAVAILABLE when stopped) the caller keeps it; done is not called.
  absl::Status Enqueue(std::shared_ptr<InferTask> task);

  // Stops accepting; fails queued tasks with UNAVAILABLE; lets the running batch finish and
  // joins the thread. Idempotent.
  void Stop();

  int64_t queued_tokens() const;

 private:
  struct Piece {
    InferTask* task;
    int64_t row;  // first row of the task in this batch
    int64_t rows;
  };
  void Loop();
  void Finish(InferTask& task, absl::Status status);

  const BatcherOptions options_;
  const Executor executor_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<InferTask>> queue_;  // guarded by mu_
  int64_t queued_tokens_ = 0;                     // guarded by mu_
  bool stopping_ = false;                         // guarded by mu_
  std::thread thread_;
};

}  // namespace epserve::server
