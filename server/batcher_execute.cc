// The batcher's executor and completion threads, and the direct start of a small request on
// an idle pipeline (batcher.h).
#include "absl/strings/str_cat.h"
#include "common/parallel.h"
#include "server/batcher.h"

namespace epserve::server {

bool Batcher::MayStartDirectly(const InferTask& task) const {
  return pipelined_.start && options_.max_queue_delay_us == 0 &&
         task.num_tokens <= std::min(options_.direct_batch_tokens, options_.max_batch_tokens) &&
         executor_idle_ && !forming_ && !starting_directly_ && queued_tokens_ == 0 &&
         barrier_fn_ == nullptr && !barrier_running_;
}

void Batcher::StartDirectly(Batch* b, std::shared_ptr<InferTask> task) {
  const int64_t rows = task->num_tokens;
  b->layer_pos = task->layer_pos;
  b->rows = rows;
  b->input_time = absl::ZeroDuration();
  task->rows_taken = rows;
  task->first_batched = absl::Now();
  // The piece holds the reference the queue would have held.
  b->pieces.push_back({std::move(task), 0, rows, 0, false});
  StageInputs(*b, 0);
  PrepareChunks(b);
  if (!b->chunks.empty()) {
    absl::StatusOr<uint64_t> ticket = pipelined_.start(b->layer_pos, b->chunks);
    if (ticket.ok()) {
      b->ticket = *ticket;
    } else {
      b->status = ticket.status();  // the executor fails the batch with it
    }
  }
  b->direct = true;
  ready_.Push(b);  // the executor, claimed for it, takes nothing else meanwhile
  {
    std::lock_guard<std::mutex> lock(mu_);
    starting_directly_ = false;
  }
  cv_.notify_all();
}

void Batcher::ExecuteLoop() {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      executor_idle_ = true;
    }
    cv_.notify_all();
    Batch* b = ready_.Pop();
    if (b == nullptr) break;
    PrepareChunks(b);
    if (!b->chunks.empty()) {
      const absl::Time t0 = absl::Now();
      b->status = executor_(b->layer_pos, b->chunks);
      b->infer_time = absl::Now() - t0;
    }
    Complete(b);
  }
  finished_.Close();
}

void Batcher::ExecutePipelined() {
  Batch* running = nullptr;  // started, not finished
  auto finish = [&](Batch* b) {
    b->status = pipelined_.finish(b->ticket, b->layer_pos, b->chunks);
    b->infer_time = absl::Now() - b->started;
    Complete(b);
  };
  while (true) {
    Batch* b = nullptr;
    if (running == nullptr) {
      // Idle only while no batch is there: the forming batch goes to an idle executor as it
      // is, and one handed over full while the last one ran must not leave it marked idle.
      b = ready_.PopFor(absl::ZeroDuration());
      if (b == nullptr) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          executor_idle_ = true;
        }
        cv_.notify_all();
        b = ready_.Pop();
        if (b == nullptr) break;
        std::lock_guard<std::mutex> lock(mu_);
        executor_idle_ = false;
      }
    } else {
      b = NextOrFinished(*running);
      if (b == nullptr) {
        finish(running);
        running = nullptr;
        continue;
      }
    }
    absl::StatusOr<uint64_t> ticket = uint64_t{0};
    if (b->direct) {
      // Started by its request's thread while this one waited idle (StartDirectly), so no
      // batch runs: it runs now, or its start failed.
      b->direct = false;
      ticket = b->status.ok() ? absl::StatusOr<uint64_t>(b->ticket) : b->status;
    } else {
      PrepareChunks(b);
      if (!b->chunks.empty()) ticket = pipelined_.start(b->layer_pos, b->chunks);
    }
    // The running batch ends before this one is answered (answers in order).
    if (running != nullptr) finish(running);
    running = nullptr;
    if (b->chunks.empty()) {
      Complete(b);
    } else if (!ticket.ok()) {
      b->status = ticket.status();
      b->infer_time = absl::Now() - b->started;
      Complete(b);
    } else {
      b->ticket = *ticket;
      running = b;
    }
  }
  finished_.Close();
}

Batcher::Batch* Batcher::NextOrFinished(const Batch& running) {
  if (!pipelined_.finished) return ready_.PopFor(absl::ZeroDuration());
  const absl::Time start = absl::Now();
  absl::Duration wait = options_.end_poll;
  while (true) {
    if (Batch* b = ready_.PopFor(wait)) return b;
    if (ready_.closed() || pipelined_.finished(running.ticket)) return nullptr;
    // Notices the end at most about end_poll or 1/64 of the batch's time late (as
    // Coordinator::WaitDone): within microseconds where the host has threads to spare, and
    // a long batch is not looked at thousands of times.
    wait = std::max(options_.end_poll, (absl::Now() - start) / 64);
  }
}

void Batcher::PrepareChunks(Batch* b) {
  const int64_t h = model_.hidden_size;
  const int64_t k = model_.top_k;
  const absl::Time now = absl::Now();
  b->status = absl::OkStatus();
  b->infer_time = absl::ZeroDuration();
  b->started = now;
  b->chunks.clear();
  for (Piece& p : b->pieces) {
    InferTask& t = *p.task;
    // Rows whose request is already answered, cancelled or expired cost no compute.
    if (absl::Status drop = Dropped(t, now); !drop.ok()) {
      if (on_rows_skipped_) on_rows_skipped_(drop.code(), p.rows);
      Fail(t, std::move(drop));
      p.skipped = true;
      continue;
    }
    // The request's own rows where the executor converts them or they are FP32, else the
    // batch's FP32 staging.
    const bool own_in = options_.executor_converts || t.input_type == common::ElementType::kFp32;
    const bool own_out = options_.executor_converts || t.output_type == common::ElementType::kFp32;
    // (rows in CUDA memory have no host address; those in system shared memory have one, for
    // rank 0's copies where the workers do not take them)
    const bool cuda_in = t.device_input.valid() && !t.device_input.in_host_shm();
    const bool cuda_out = t.device_output.valid() && !t.device_output.in_host_shm();
    const void* in =
        cuda_in ? nullptr
        : own_in
            ? static_cast<const void*>(t.input + p.row * h * common::ElementBytes(t.input_type))
            : b->input_staging.data() + p.at * h;
    void* out = cuda_out ? nullptr
                : own_out
                    ? static_cast<void*>(t.output + p.row * h * common::ElementBytes(t.output_type))
                    : b->output_staging.data() + p.at * h;
    b->chunks.push_back({in, out, p.rows, t.topk_ids ? t.topk_ids + p.row * k : nullptr,
                         t.topk_weights ? t.topk_weights + p.row * k : nullptr,
                         own_in ? t.input_type : common::ElementType::kFp32,
                         own_out ? t.output_type : common::ElementType::kFp32});
    worker::RowChunk& c = b->chunks.back();
    if (t.device_input.valid()) c.device_input = t.device_input.Advanced(p.row, h);
    if (t.device_output.valid()) c.device_output = t.device_output.Advanced(p.row, h);
  }
}

void Batcher::CompleteLoop() {
  while (Batch* b = finished_.Pop()) {
    CompleteBatch(b);
    completions_pending_.fetch_sub(1, std::memory_order_release);
  }
}

void Batcher::Complete(Batch* b) {
  // Nothing handed to the completion thread is unanswered: every earlier batch is answered,
  // so answering this one here keeps the order (only this thread hands batches over).
  if (b->rows <= options_.direct_batch_tokens &&
      completions_pending_.load(std::memory_order_acquire) == 0) {
    return CompleteBatch(b);
  }
  completions_pending_.fetch_add(1, std::memory_order_relaxed);
  finished_.Push(b);
}

void Batcher::CompleteBatch(Batch* b) {
  const int64_t h = model_.hidden_size;
  const absl::Time t0 = absl::Now();
  for (const Piece& p : b->pieces) {
    InferTask& t = *p.task;
    if (p.skipped) continue;
    if (!b->status.ok()) {
      Fail(t, b->status);
    } else if (!options_.executor_converts && t.output_type != common::ElementType::kFp32 &&
               !t.failed.load()) {
      const float* src = b->output_staging.data() + p.at * h;
      char* dst = t.output + p.row * h * common::ElementBytes(t.output_type);
      common::ParallelFor(
          options_.copy_threads, p.rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
            FromFp32(t.output_type, src + begin * h,
                     dst + begin * h * common::ElementBytes(t.output_type), (end - begin) * h);
          });
    }
  }
  b->output_time = absl::Now() - t0;
  for (const Piece& p : b->pieces) {
    InferTask& t = *p.task;
    if (!p.skipped) {
      t.times.compute_input += b->input_time;
      t.times.compute_infer += b->infer_time;
      t.times.compute_output += b->output_time;
    }
    // A small batch's few answers go from here: a responder's wake-up would cost more.
    if (b->rows <= options_.direct_batch_tokens) {
      Release(*p.task);
    } else {
      ReleaseToRespond(p.task);
    }
  }
  if (observer_ && b->status.ok() && !b->chunks.empty()) {
    int64_t rows = 0;
    for (const worker::RowChunk& c : b->chunks) rows += c.rows;
    observer_(rows, b->input_time, b->infer_time, b->output_time, absl::Now() - t0);
  }
  b->pieces.clear();
  free_.Push(b);
}

}  // namespace epserve::server
