#include "server/batcher.h"

#include "absl/strings/str_cat.h"
#include "common/parallel.h"

namespace epserve::server {
void Batcher::Channel::Push(Batch* b) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return items_.size() < capacity_; });
    items_.push_back(b);
  }
  cv_.notify_all();
}

Batcher::Batch* Batcher::Channel::PopFor(absl::Duration timeout) {
  Batch* b = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                 [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return nullptr;
    b = items_.front();
    items_.pop_front();
  }
  cv_.notify_all();
  return b;
}

Batcher::Batch* Batcher::Channel::Pop() {
  Batch* b = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return nullptr;
    b = items_.front();
    items_.pop_front();
  }
  cv_.notify_all();
  return b;
}

void Batcher::Channel::WaitNotFull() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return items_.size() < capacity_; });
}

bool Batcher::Channel::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void Batcher::Channel::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

absl::Status BatchingOptions::Validate() const {
  if (max_batch_tokens < 1) return absl::InvalidArgumentError("--max-batch-tokens must be >= 1");
  if (max_queue_delay_us < 0)
    return absl::InvalidArgumentError("--max-queue-delay-us must be >= 0");
  if (direct_batch_tokens < 0)
    return absl::InvalidArgumentError("--direct-batch-tokens must be >= 0");
  return absl::OkStatus();
}

Batcher::Batcher(const BatchingOptions& options, const ServedModel& model, int64_t priority_levels,
                 Executor executor, BatchObserver observer, SkipObserver on_rows_skipped)
    : Batcher(options, model, priority_levels, std::move(executor), PipelinedExecutor{},
              std::move(observer), std::move(on_rows_skipped)) {}

Batcher::Batcher(const BatchingOptions& options, const ServedModel& model, int64_t priority_levels,
                 PipelinedExecutor executor, BatchObserver observer, SkipObserver on_rows_skipped)
    : Batcher(options, model, priority_levels, nullptr, std::move(executor), std::move(observer),
              std::move(on_rows_skipped)) {}

Batcher::Batcher(const BatchingOptions& options, const ServedModel& model, int64_t priority_levels,
                 Executor executor, PipelinedExecutor pipelined, BatchObserver observer,
                 SkipObserver on_rows_skipped)
    : options_(options),
      model_(model),
      executor_(std::move(executor)),
      pipelined_(std::move(pipelined)),
      observer_(std::move(observer)),
      on_rows_skipped_(std::move(on_rows_skipped)),
      queues_(std::max<int64_t>(priority_levels, 1)),
      queued_rows_(std::max<size_t>(model.layers.size(), 1), 0) {
  for (int i = 0; i < kBatches; ++i) {
    batches_.push_back(std::make_unique<Batch>());
    free_.Push(batches_.back().get());
  }
  form_thread_ = std::thread([this] {
    common::NameThisThread("ep-form");
    FormLoop();
  });
  execute_thread_ = std::thread([this] {
    common::NameThisThread("ep-execute");
    common::SleepPrecisely();  // its looks at a running batch's end (NextOrFinished)
    pipelined_.start ? ExecutePipelined() : ExecuteLoop();
  });
  complete_thread_ = std::thread([this] {
    common::NameThisThread("ep-complete");
    CompleteLoop();
  });
  if (options_.respond_threads > 1) {
    for (int i = 0; i < options_.respond_threads; ++i) {
      responders_.emplace_back([this] {
        common::NameThisThread("ep-respond");
        RespondLoop();
      });
    }
  }
}

void Batcher::ReleaseToRespond(const std::shared_ptr<InferTask>& task) {
  if (responders_.empty()) return Release(*task);
  if (task->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  {
    std::lock_guard<std::mutex> lock(respond_mu_);
    to_respond_.push_back(task);
  }
  respond_cv_.notify_one();
}

void Batcher::RespondLoop() {
  while (true) {
    std::shared_ptr<InferTask> task;
    {
      std::unique_lock<std::mutex> lock(respond_mu_);
      respond_cv_.wait(lock, [&] { return respond_closed_ || !to_respond_.empty(); });
      if (to_respond_.empty()) return;
      task = std::move(to_respond_.front());
      to_respond_.pop_front();
    }
    Answer(*task);
  }
}

Batcher::~Batcher() { Stop(); }

absl::Status Batcher::Enqueue(std::shared_ptr<InferTask> task) {
  if (task->layer_pos < 0 || task->layer_pos >= static_cast<int>(queued_rows_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer position ", task->layer_pos,
                                                   " outside [0, ", queued_rows_.size(), ")"));
  }
  if (task->priority < 1 || task->priority > queues_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("priority ", task->priority, " outside [1, ", queues_.size(), "]"));
  }
  if (task->num_tokens < 1) return absl::InvalidArgumentError("a request needs >= 1 token");
  Batch* direct = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (queued_tokens_ + task->num_tokens > options_.max_queue_tokens) {
      return absl::ResourceExhaustedError(
          absl::StrCat("queue full: ", queued_tokens_, " tokens queued, ", task->num_tokens,
                       " more would exceed --max-queue-tokens=", options_.max_queue_tokens));
    }
    // A free batch is taken under mu_ (the channels never take it, so no lock order
    // inverts); the executor is claimed, so the formation thread hands it nothing meanwhile.
    if (MayStartDirectly(*task) && (direct = free_.PopFor(absl::ZeroDuration())) != nullptr) {
      executor_idle_ = false;
      starting_directly_ = true;
    } else {
      queued_tokens_ += task->num_tokens;
      queued_rows_[task->layer_pos] += task->num_tokens;
      queues_[task->priority - 1].push_back(std::move(task));
    }
  }
  if (direct != nullptr) {
    StartDirectly(direct, std::move(task));
  } else {
    cv_.notify_one();
  }
  return absl::OkStatus();
}

int64_t Batcher::queued_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_tokens_;
}

void Batcher::Stop() {
  std::call_once(stop_once_, [this] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    barrier_cv_.notify_all();
    form_thread_.join();
    execute_thread_.join();
    complete_thread_.join();
    {
      std::lock_guard<std::mutex> lock(respond_mu_);
      respond_closed_ = true;
    }
    respond_cv_.notify_all();
    for (std::thread& t : responders_) t.join();
  });
}

absl::Status Batcher::RunBetweenRequests(std::function<absl::Status()> fn) {
  std::lock_guard<std::mutex> call(barrier_call_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  barrier_fn_ = std::move(fn);
  const uint64_t ticket = barriers_run_ + 1;
  cv_.notify_all();
  barrier_cv_.wait(lock, [&] { return barriers_run_ >= ticket || stopping_; });
  if (barriers_run_ < ticket) {
    barrier_fn_ = nullptr;
    return absl::UnavailableError("the server is shutting down");
  }
  return barrier_status_;
}

const InferTask* Batcher::PartlyTaken() const {
  for (const auto& q : queues_) {
    for (const auto& t : q) {
      if (t->rows_taken > 0) return t.get();  // queued, so not all taken
    }
  }
  return nullptr;
}

void Batcher::MaybeRunBarrier(std::unique_lock<std::mutex>& lock) {
  if (barrier_fn_ == nullptr || PartlyTaken() != nullptr) return;
  cv_.wait(lock, [&] { return stopping_ || executor_idle_; });
  if (stopping_) return;
  // The executor waits for a batch, and only this thread hands it one.
  std::function<absl::Status()> fn = std::move(barrier_fn_);
  barrier_fn_ = nullptr;
  barrier_running_ = true;  // no request starts directly meanwhile
  lock.unlock();
  absl::Status status = fn();
  lock.lock();
  barrier_running_ = false;
  barrier_status_ = std::move(status);
  ++barriers_run_;
  barrier_cv_.notify_all();
}

void Batcher::Fail(InferTask& task, absl::Status status) {
  std::lock_guard<std::mutex> lock(task.mu);
  if (task.status.ok()) task.status = std::move(status);
  task.failed.store(true, std::memory_order_release);
}

void Batcher::Release(InferTask& task) {
  if (task.refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  Answer(task);
}

void Batcher::Answer(InferTask& task) {
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(task.mu);
    status = task.status;
  }
  task.times.queue = std::min(task.first_batched, absl::Now()) - task.enqueued;
  task.done(std::move(status), task.times);
}

absl::Status Batcher::Dropped(InferTask& task, absl::Time now) {
  if (task.failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(task.mu);
    return task.status;
  }
  if (task.cancelled && task.cancelled()) {
    return absl::CancelledError("request cancelled before its rows were computed");
  }
  if (now >= task.deadline) {
    return absl::DeadlineExceededError("request deadline passed before its rows were computed");
  }
  return absl::OkStatus();
}

bool Batcher::TakePieces(std::unique_lock<std::mutex>& lock, Batch& batch,
                         std::vector<std::shared_ptr<InferTask>>& to_release) {
  auto head = [&]() -> InferTask* {
    for (auto& q : queues_) {
      if (!q.empty()) return q.front().get();
    }
    return nullptr;
  };
  // Wait for a full batch of the head's layer, or until the head has waited long enough.
  // The head is the oldest request of the highest priority level that has one.
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || head() != nullptr || barrier_fn_ != nullptr; });
    if (stopping_) return false;
    if (barrier_fn_ != nullptr) {
      // Only requests already begun are continued; none: an empty batch, and the barrier runs.
      if (const InferTask* partly = PartlyTaken()) {
        batch.layer_pos = partly->layer_pos;
        AppendPieces(batch, to_release);
      }
      return true;
    }
    const InferTask& h = *head();
    const absl::Time flush_at = h.enqueued + options_.max_queue_delay();
    if (queued_rows_[h.layer_pos] >= options_.max_batch_tokens || absl::Now() >= flush_at) break;
    cv_.wait_for(lock, absl::ToChronoNanoseconds(flush_at - absl::Now()));
  }
  batch.layer_pos = head()->layer_pos;
  AppendPieces(batch, to_release);
  return true;
}

void Batcher::AppendPieces(Batch& batch, std::vector<std::shared_ptr<InferTask>>& to_release) {
  const int layer_pos = batch.layer_pos;
  const absl::Time now = absl::Now();
  int64_t& rows = batch.rows;
  for (auto& q : queues_) {
    for (auto it = q.begin(); it != q.end() && rows < options_.max_batch_tokens;) {
      InferTask& t = **it;
      if (t.layer_pos != layer_pos || (barrier_fn_ != nullptr && t.rows_taken == 0)) {
        ++it;  // another layer's, or not begun while a barrier waits for the begun ones
        continue;
      }
      if (absl::Status drop = Dropped(t, now); !drop.ok()) {
        const int64_t left = t.num_tokens - t.rows_taken;
        queued_tokens_ -= left;
        queued_rows_[layer_pos] -= left;
        if (on_rows_skipped_) on_rows_skipped_(drop.code(), left);
        Fail(t, std::move(drop));
        to_release.push_back(std::move(*it));
        it = q.erase(it);
        continue;
      }
      const int64_t take = std::min(t.num_tokens - t.rows_taken, options_.max_batch_tokens - rows);
      t.refs.fetch_add(1, std::memory_order_relaxed);
      batch.pieces.push_back({*it, t.rows_taken, take, rows, false});
      t.rows_taken += take;
      rows += take;
      queued_tokens_ -= take;
      queued_rows_[layer_pos] -= take;
      if (t.rows_taken == t.num_tokens) {
        to_release.push_back(std::move(*it));  // the queue's reference
        it = q.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void Batcher::StageInputs(Batch& b, size_t first) {
  if (options_.executor_converts) return;
  const int64_t h = model_.hidden_size;
  const absl::Time t0 = absl::Now();
  for (size_t i = first; i < b.pieces.size(); ++i) {
    const Piece& p = b.pieces[i];
    const InferTask& t = *p.task;
    if (t.input_type != common::ElementType::kFp32) {
      if (b.input_staging.empty()) b.input_staging.resize(options_.max_batch_tokens * h);
      const char* src = t.input + p.row * h * common::ElementBytes(t.input_type);
      float* dst = b.input_staging.data() + p.at * h;
      common::ParallelFor(
          options_.copy_threads, p.rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
            ToFp32(t.input_type, src + begin * h * common::ElementBytes(t.input_type),
                   dst + begin * h, (end - begin) * h);
          });
    }
    if (t.output_type != common::ElementType::kFp32 && b.output_staging.empty()) {
      b.output_staging.resize(options_.max_batch_tokens * h);
    }
  }
  b.input_time += absl::Now() - t0;
}

void Batcher::FormLoop() {
  while (true) {
    ready_.WaitNotFull();  // form the next batch only once the previous one has started
    Batch* b = free_.Pop();
    b->rows = 0;
    b->input_time = absl::ZeroDuration();
    std::vector<std::shared_ptr<InferTask>> to_release;
    bool running;
    {
      std::unique_lock<std::mutex> lock(mu_);
      MaybeRunBarrier(lock);
      running = TakePieces(lock, *b, to_release);
      forming_ = running && !b->pieces.empty();
      if (!running) {
        for (auto& q : queues_) {
          for (auto& t : q) {
            Fail(*t, absl::UnavailableError("the server is shutting down"));
            to_release.push_back(std::move(t));
          }
          q.clear();
        }
        queued_tokens_ = 0;
        std::fill(queued_rows_.begin(), queued_rows_.end(), 0);
      }
    }
    for (auto& t : to_release) Release(*t);
    to_release.clear();
    if (!running) {
      free_.Push(b);
      {
        // A request being started directly hands its batch to the executor first.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !starting_directly_; });
      }
      ready_.Close();
      return;
    }
    if (b->pieces.empty()) {
      free_.Push(b);
      continue;
    }
    StageInputs(*b, 0);
    // While the executor still runs the previous batch, take in rows as they arrive.
    while (true) {
      const size_t staged = b->pieces.size();
      {
        std::unique_lock<std::mutex> lock(mu_);
        // A pipelined executor starts a full batch while it runs the one before: it goes now.
        const bool hand_over_full = pipelined_.start && b->rows >= options_.max_batch_tokens;
        // Nothing goes to the executor while a request started directly is on its way there
        // (it would be started second and finished first).
        auto hand_over = [&] {
          return !starting_directly_ && (stopping_ || executor_idle_ || hand_over_full);
        };
        cv_.wait(lock, [&] {
          return hand_over() || (barrier_fn_ == nullptr && b->rows < options_.max_batch_tokens &&
                                 queued_rows_[b->layer_pos] > 0);
        });
        if (hand_over()) {
          executor_idle_ = false;  // this batch is the executor's next
          forming_ = false;
          break;
        }
        AppendPieces(*b, to_release);
      }
      for (auto& t : to_release) Release(*t);
      to_release.clear();
      StageInputs(*b, staged);
    }
    // A request's queueing ends when its first rows go to the executor, not when they join a
    // batch that still waits.
    const absl::Time handed = absl::Now();
    for (const Piece& p : b->pieces) {
      if (p.task->first_batched == absl::InfiniteFuture()) p.task->first_batched = handed;
    }
    ready_.Push(b);
  }
}

}  // namespace epserve::server
