#include "server/batcher.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace epserve::server {

Batcher::Batcher(BatcherOptions options, Executor executor)
    : options_(options), executor_(std::move(executor)), thread_([this] { Loop(); }) {}

Batcher::~Batcher() { Stop(); }

absl::Status Batcher::Enqueue(std::shared_ptr<InferTask> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (queued_tokens_ + task->num_tokens > options_.max_queue_tokens) {
      return absl::ResourceExhaustedError(
          absl::StrCat("queue full: ", queued_tokens_, " tokens queued, ", task->num_tokens,
                       " more would exceed --max-queue-tokens=", options_.max_queue_tokens));
    }
    queued_tokens_ += task->num_tokens;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return absl::OkStatus();
}

int64_t Batcher::queued_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_tokens_;
}

void Batcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Batcher::Finish(InferTask& task, absl::Status status) {
  const absl::Time batched = std::min(task.first_batched, absl::Now());
  task.done(std::move(status), batched - task.enqueued);
}

void Batcher::Loop() {
  std::vector<std::shared_ptr<InferTask>> owned;  // tasks with rows in the current batch
  std::vector<Piece> pieces;
  std::vector<worker::RowChunk> chunks;
  const size_t row_bytes = static_cast<size_t>(options_.hidden_size) * sizeof(float);
  while (true) {
    owned.clear();
    pieces.clear();
    chunks.clear();
    int layer_pos = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) {
        for (auto& task : queue_) {
          if (!task->failed) Finish(*task, absl::UnavailableError("the server is shutting down"));
        }
        queue_.clear();
        queued_tokens_ = 0;
        return;
      }
      // Wait for a full batch of the head's layer, or until the head has waited long enough.
      const absl::Time flush_at = queue_.front()->enqueued + options_.max_queue_delay;
      auto ready = [&] {
        if (stopping_ || queue_.empty()) return true;
        int64_t rows = 0;
        for (const auto& t : queue_) {
          if (t->layer_pos == queue_.front()->layer_pos) rows += t->num_tokens - t->rows_taken;
          if (rows >= options_.max_batch_tokens) return true;
        }
        return false;
      };
      while (!ready() && absl::Now() < flush_at) {
        cv_.wait_for(lock, absl::ToChronoNanoseconds(flush_at - absl::Now()));
      }
      if (stopping_ || queue_.empty()) continue;
      // Take rows, in queue order, of the head's layer.
      layer_pos = queue_.front()->layer_pos;
      int64_t rows = 0;
      const absl::Time now = absl::Now();
      for (auto it = queue_.begin(); it != queue_.end() && rows < options_.max_batch_tokens;) {
        InferTask& t = **it;
        if (t.failed) {  // an earlier part failed and was answered: drop the rest
          queued_tokens_ -= t.num_tokens - t.rows_taken;
          it = queue_.erase(it);
          continue;
        }
        if (t.layer_pos != layer_pos) {
          ++it;
          continue;
        }
        if (t.rows_taken == 0) {
          absl::Status dropped;
          if (t.cancelled && t.cancelled()) {
            dropped = absl::CancelledError("request cancelled before it was batched");
          } else if (now >= t.deadline) {
            dropped = absl::DeadlineExceededError("request deadline passed while queued");
          }
          if (!dropped.ok()) {
            queued_tokens_ -= t.num_tokens;
            Finish(t, dropped);
            it = queue_.erase(it);
            continue;
          }
          t.first_batched = now;
        }
        const int64_t take =
            std::min(t.num_tokens - t.rows_taken, options_.max_batch_tokens - rows);
        pieces.push_back({&t, t.rows_taken, take});
        owned.push_back(*it);
        t.rows_taken += take;
        rows += take;
        queued_tokens_ -= take;
        if (t.rows_taken == t.num_tokens) {
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (pieces.empty()) continue;
    for (const Piece& p : pieces) {
      chunks.push_back({reinterpret_cast<const float*>(p.task->input + p.row * row_bytes),
                        reinterpret_cast<float*>(p.task->output + p.row * row_bytes), p.rows});
    }
    const absl::Status status = executor_(layer_pos, chunks);
    for (const Piece& p : pieces) {
      InferTask& t = *p.task;
      if (t.failed) continue;
      if (!status.ok()) {
        t.failed = true;
        // Rows of this task still queued are skipped when their turn comes.
        Finish(t, status);
      } else if (p.row + p.rows == t.num_tokens) {
        Finish(t, absl::OkStatus());
      }
    }
  }
}

}  // namespace epserve::server
