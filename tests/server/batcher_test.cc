#include "server/batcher.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "tests/server/batcher_fakes.h"

namespace epserve::server {
namespace {

using common::ElementType;
using namespace batcher_test;  // NOLINT: the fakes are this file's vocabulary

TEST(Batcher, SplitsLargeRequestsAndReassemblesEveryAnswerInOrder) {
  Recorder rec;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(8), kModel, kLevels, rec.Executor());
    std::mt19937 rng(std::random_device{}());
    for (int i = 0; i < 20; ++i) {
      reqs.push_back(MakeRequest(1 + rng() % 30, 1000.0f * i));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    WaitDone(reqs);
  }
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    EXPECT_TRUE(r->status.ok()) << r->status;
    for (size_t i = 0; i < r->in.size(); ++i) ASSERT_EQ(r->out[i], 2 * r->in[i]);
  }
  for (int64_t rows : rec.batch_rows) EXPECT_LE(rows, 8);
}

// With a pipelined executor the next batch starts before the running one finishes (never a
// third), batches finish in the order they started, every answer is right and arrives once
// (given by responder threads), and a failed start or finish fails exactly its own batch's
// requests.
TEST(Batcher, PipelinedExecutorKeepsTwoBatchesInFlightAndAnswersEveryRequestOnce) {
  struct Pipeline {
    std::mutex mu;
    std::deque<uint64_t> started;  // tickets not finished, in order
    uint64_t next = 1;
    int most_in_flight = 0;
    int overlapped = 0;  // starts made while another batch was in flight
    bool out_of_order = false;
    std::map<uint64_t, std::vector<worker::RowChunk>> chunks;
    std::set<uint64_t> fail_start, fail_finish;
  } p;
  Batcher::PipelinedExecutor exec;
  exec.start = [&p](int, std::span<const worker::RowChunk> c) -> absl::StatusOr<uint64_t> {
    std::lock_guard<std::mutex> lock(p.mu);
    const uint64_t t = p.next++;
    if (p.fail_start.count(t) > 0) return absl::InternalError("start failed");
    if (!p.started.empty()) ++p.overlapped;
    p.started.push_back(t);
    p.most_in_flight = std::max<int>(p.most_in_flight, static_cast<int>(p.started.size()));
    p.chunks[t].assign(c.begin(), c.end());
    return t;
  };
  exec.finish = [&p](uint64_t t, int, std::span<const worker::RowChunk> c) -> absl::Status {
    // A batch takes a while, as on the workers: the next one is formed meanwhile.
    absl::SleepFor(absl::Milliseconds(2));
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.started.empty() || p.started.front() != t) p.out_of_order = true;
    if (!p.started.empty()) p.started.pop_front();
    EXPECT_EQ(c.size(), p.chunks[t].size());
    for (const auto& chunk : c) {
      for (int64_t i = 0; i < chunk.rows * kHidden; ++i)
        chunk.fp32_output()[i] = 2 * chunk.fp32_input()[i];
    }
    if (p.fail_finish.count(t) > 0) return absl::UnavailableError("finish failed");
    return absl::OkStatus();
  };
  // Batch 3's start and batch 6's finish fail; with requests of one batch each (8 rows),
  // exactly those requests fail.
  p.fail_start = {3};
  p.fail_finish = {6};
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    BatchingOptions options = Options(8);
    options.respond_threads = 3;  // answers handed to gRPC off the completion thread
    Batcher b(options, kModel, kLevels, exec);
    for (int i = 0; i < 40; ++i) {
      reqs.push_back(MakeRequest(8, 100.0f * i));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    WaitDone(reqs);
  }
  int failed = 0;
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    if (!r->status.ok()) {
      ++failed;
      continue;
    }
    for (size_t i = 0; i < r->in.size(); ++i) ASSERT_EQ(r->out[i], 2 * r->in[i]);
  }
  EXPECT_EQ(failed, 2);
  EXPECT_FALSE(p.out_of_order);
  EXPECT_LE(p.most_in_flight, 2);
  // 40 full batches queued: the next one is usually there to start (a formed batch that
  // waited for the executor to be idle, as batches once did, never overlaps).
  EXPECT_GT(p.overlapped, 0);
  EXPECT_TRUE(p.started.empty());
}

// With `finished`, a batch formed while another runs starts at once beside it (its rows go in
// while the workers compute), however late in the running batch it is formed; and the batch
// formed after it keeps taking rows until it is full or the executor has nothing to run (the
// executor that took a batch handed over full is not idle).
TEST(Batcher, PipelinedExecutorStartsABatchFormedWhileOneRunsAndFillsTheNext) {
  struct Gated {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t next = 1;
    std::deque<uint64_t> started;      // tickets not finished, in order
    std::set<uint64_t> open;           // tickets whose batch may end
    std::vector<bool> started_beside;  // per start: was another batch in flight
    std::vector<int64_t> rows;         // per start
  } g;
  Batcher::PipelinedExecutor exec;
  exec.start = [&g](int, std::span<const worker::RowChunk> c) -> absl::StatusOr<uint64_t> {
    std::lock_guard<std::mutex> lock(g.mu);
    int64_t rows = 0;
    for (const auto& chunk : c) {
      for (int64_t i = 0; i < chunk.rows * kHidden; ++i)
        chunk.fp32_output()[i] = 2 * chunk.fp32_input()[i];
      rows += chunk.rows;
    }
    g.started_beside.push_back(!g.started.empty());
    g.rows.push_back(rows);
    g.started.push_back(g.next);
    g.cv.notify_all();
    return g.next++;
  };
  exec.finished = [&g](uint64_t t) {
    std::lock_guard<std::mutex> lock(g.mu);
    return g.open.count(t) > 0;
  };
  exec.finish = [&g](uint64_t t, int, std::span<const worker::RowChunk>) -> absl::Status {
    std::unique_lock<std::mutex> lock(g.mu);
    if (!g.cv.wait_for(lock, std::chrono::seconds(20), [&] { return g.open.count(t) > 0; })) {
      return absl::DeadlineExceededError("the test never let the batch end");
    }
    EXPECT_EQ(g.started.front(), t);
    g.started.pop_front();
    g.cv.notify_all();
    return absl::OkStatus();
  };
  auto wait_started = [&g](size_t n) {
    std::unique_lock<std::mutex> lock(g.mu);
    return g.cv.wait_for(lock, std::chrono::seconds(20), [&] { return g.rows.size() >= n; });
  };
  auto let_end = [&g](uint64_t t) {
    std::lock_guard<std::mutex> lock(g.mu);
    g.open.insert(t);
    g.cv.notify_all();
  };
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    // No queue delay: a batch goes as soon as the executor has nothing to run.
    Batcher b(Options(8, absl::ZeroDuration()), kModel, kLevels, exec);
    auto enqueue = [&](int64_t tokens) {
      reqs.push_back(MakeRequest(tokens, 100.0f * reqs.size()));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    };
    enqueue(8);
    ASSERT_TRUE(wait_started(1));
    absl::SleepFor(absl::Milliseconds(50));  // well into the first batch
    enqueue(8);
    ASSERT_TRUE(wait_started(2));  // beside the first, which has not ended
    let_end(1);
    {
      std::unique_lock<std::mutex> lock(g.mu);
      ASSERT_TRUE(
          g.cv.wait_for(lock, std::chrono::seconds(20), [&] { return g.started.size() == 1; }));
    }
    // The second runs alone; rows that arrive now wait for a full batch.
    enqueue(4);
    absl::SleepFor(absl::Milliseconds(50));
    enqueue(4);
    ASSERT_TRUE(wait_started(3));
    let_end(2);
    let_end(3);
    WaitDone(reqs);
  }
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    EXPECT_TRUE(r->status.ok()) << r->status;
    for (size_t i = 0; i < r->in.size(); ++i) ASSERT_EQ(r->out[i], 2 * r->in[i]);
  }
  EXPECT_EQ(g.rows, (std::vector<int64_t>{8, 8, 8}));
  EXPECT_EQ(g.started_beside, (std::vector<bool>{false, true, true}));
}

TEST(Batcher, FillsBatchesWhenRowsAreWaiting) {
  Recorder rec;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    // A long delay: a full batch must go at once, not after the delay.
    Batcher b(Options(16, absl::Seconds(5)), kModel, kLevels, rec.Executor());
    const absl::Time start = absl::Now();
    for (int i = 0; i < 4; ++i) {
      reqs.push_back(MakeRequest(4, 0));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    WaitDone(reqs);
    EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  }
  ASSERT_EQ(rec.batch_rows.size(), 1u);
  EXPECT_EQ(rec.batch_rows[0], 16);
}

TEST(Batcher, ABatchHoldsOneLayer) {
  Recorder rec;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(64, absl::Milliseconds(20)), kModel, kLevels, rec.Executor());
    for (int i = 0; i < 6; ++i) {
      reqs.push_back(MakeRequest(3, i, i % 2));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    WaitDone(reqs);
  }
  ASSERT_EQ(rec.layers.size(), 2u);
  EXPECT_NE(rec.layers[0], rec.layers[1]);
  for (const auto& r : reqs) EXPECT_TRUE(r->status.ok());
}

TEST(Batcher, FullQueueIsResourceExhaustedAndTheCallerKeepsTheTask) {
  Recorder rec;
  BatchingOptions o = Options(8, absl::Seconds(5));
  o.max_queue_tokens = 10;
  Batcher b(o, kModel, kLevels, rec.Executor());
  auto big = MakeRequest(11, 0);
  absl::Status s = b.Enqueue(big->task);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max-queue-tokens=10"), absl::string_view::npos) << s;
  EXPECT_EQ(big->calls, 0);
}

TEST(Batcher, ExecutorErrorsReachEveryRequestOfTheBatchOnce) {
  Recorder rec;
  rec.fail_with = absl::UnavailableError("workers gone");
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(8), kModel, kLevels, rec.Executor());
    for (int i = 0; i < 3; ++i) {
      reqs.push_back(MakeRequest(20, 0));  // each spans three batches
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    WaitDone(reqs);
    absl::SleepFor(absl::Milliseconds(50));
  }
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    EXPECT_EQ(r->status.code(), absl::StatusCode::kUnavailable);
  }
}

TEST(Batcher, StopAnswersQueuedRequestsAndRefusesNewOnes) {
  Recorder rec;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  Batcher b(Options(8, absl::Seconds(30)), kModel, kLevels, rec.Executor());
  for (int i = 0; i < 3; ++i) {
    reqs.push_back(MakeRequest(2, 0));
    ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
  }
  b.Stop();
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    EXPECT_EQ(r->status.code(), absl::StatusCode::kUnavailable);
  }
  auto late = MakeRequest(1, 0);
  EXPECT_EQ(b.Enqueue(late->task).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(late->calls, 0);
}

TEST(Batcher, CancelledAndExpiredRequestsLeaveWithoutCompute) {
  Recorder rec;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(8, absl::Milliseconds(20)), kModel, kLevels, rec.Executor());
    reqs.push_back(MakeRequest(2, 0));
    reqs.back()->task->cancelled = [] { return true; };
    reqs.push_back(MakeRequest(2, 0));
    reqs.back()->task->deadline = absl::Now();
    reqs.push_back(MakeRequest(2, 0));
    for (auto& r : reqs) ASSERT_TRUE(b.Enqueue(r->task).ok());
    WaitDone(reqs);
  }
  EXPECT_EQ(reqs[0]->status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(reqs[1]->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(reqs[2]->status.ok());
  ASSERT_EQ(rec.batch_rows.size(), 1u);
  EXPECT_EQ(rec.batch_rows[0], 2);
}

// An executor that holds the first batch until released, recording the first input value of
// every batch it runs.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  std::vector<float> first_values;
  std::vector<int64_t> rows;  // of every batch
  Batcher::Executor Executor() {
    return [this](int, std::span<const worker::RowChunk> chunks) {
      std::unique_lock<std::mutex> lock(mu);
      first_values.push_back(chunks[0].fp32_input()[0]);
      int64_t n = 0;
      for (const auto& c : chunks) n += c.rows;
      rows.push_back(n);
      cv.wait(lock, [&] { return open; });
      for (const auto& c : chunks) {
        for (int64_t i = 0; i < c.rows * kHidden; ++i) c.fp32_output()[i] = 2 * c.fp32_input()[i];
      }
      return absl::OkStatus();
    };
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
  size_t batches() {
    std::lock_guard<std::mutex> lock(mu);
    return first_values.size();
  }
};

TEST(Batcher, HigherPriorityOvertakesQueuedRequests) {
  Gate gate;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(4, absl::ZeroDuration()), kModel, kLevels, gate.Executor());
    reqs.push_back(MakeRequest(4, 1000));  // runs first and holds the executor
    ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    while (gate.batches() == 0) absl::SleepFor(absl::Milliseconds(1));
    for (int i = 1; i <= 4; ++i) {  // one full batch each, lowest priority
      reqs.push_back(MakeRequest(4, 1000.0f * (i + 1)));
      reqs.back()->task->priority = 3;
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    reqs.push_back(MakeRequest(4, 99000));
    reqs.back()->task->priority = 1;
    ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    gate.Open();
    WaitDone(reqs);
  }
  for (const auto& r : reqs) ASSERT_TRUE(r->status.ok()) << r->status;
  ASSERT_EQ(gate.first_values.size(), 6u);
  // At most one low-priority batch was formed before the high-priority request arrived.
  const auto high = std::find(gate.first_values.begin(), gate.first_values.end(), 99000.0f);
  EXPECT_LE(high - gate.first_values.begin(), 2) << "the priority-1 request ran too late";
}

TEST(Batcher, TheWaitingBatchTakesInRowsThatArriveWhileTheExecutorRuns) {
  Gate gate;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  std::mt19937 rng(std::random_device{}());
  {
    // No queueing delay: without the top-up, the batch behind the running one would hold only
    // the first request that arrived.
    Batcher b(Options(16, absl::ZeroDuration()), kModel, kLevels, gate.Executor());
    reqs.push_back(MakeRequest(4, 1000));  // holds the executor
    ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    while (gate.batches() == 0) absl::SleepFor(absl::Milliseconds(1));
    int64_t arrived = 0;
    for (int i = 1; i <= 5; ++i) {  // 1-4 rows each, arriving one by one: 5-20 rows in all
      const int64_t tokens = 1 + static_cast<int64_t>(rng() % 4);
      arrived += tokens;
      reqs.push_back(MakeRequest(tokens, 1000.0f * (i + 1)));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
      absl::SleepFor(absl::Milliseconds(10));
    }
    // Every row the waiting batch has room for leaves the queue before the executor is free.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (b.queued_tokens() > std::max<int64_t>(arrived - 16, 0) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(b.queued_tokens(), std::max<int64_t>(arrived - 16, 0));
    gate.Open();
    WaitDone(reqs);
    ASSERT_GE(gate.rows.size(), 2u);
    // The second batch took every row that arrived, up to the batch limit; the rest (if any)
    // formed the third.
    EXPECT_EQ(gate.rows[1], std::min<int64_t>(arrived, 16));
    EXPECT_EQ(gate.rows.size(), arrived > 16 ? 3u : 2u);
  }
  for (const auto& r : reqs) {
    ASSERT_EQ(r->calls, 1);
    ASSERT_TRUE(r->status.ok()) << r->status;
    for (size_t i = 0; i < r->in.size(); ++i) ASSERT_EQ(r->out[i], 2 * r->in[i]);
  }
}

// A request of `values` ([tokens, kHidden]) sent as BF16 and answered in FP16 (its answer
// poisoned: 0x7f7f is an FP16 NaN), and what its callback saw.
struct Bf16InFp16Out {
  Bf16InFp16Out(const std::vector<float>& values, int64_t tokens)
      : bf16(values.size() * 2), fp16_out(values.size() * 2, '\x7f') {
    FromFp32(ElementType::kBf16, values.data(), bf16.data(), values.size());
    task = std::make_shared<InferTask>();
    task->num_tokens = tokens;
    task->input = bf16.data();
    task->input_type = ElementType::kBf16;
    task->output = fp16_out.data();
    task->output_type = ElementType::kFp16;
    task->enqueued = absl::Now();
    task->done = [this](absl::Status s, const TaskTimes&) {
      status = s;
      calls++;
    };
  }
  // Through a batcher of `options` and `exec`; its answer, within 10 s.
  void Run(const BatchingOptions& options, Batcher::Executor exec) {
    Batcher b(options, kModel, kLevels, std::move(exec));
    ASSERT_TRUE(b.Enqueue(task).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (calls == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  }
  std::vector<float> Answer() const {
    std::vector<float> out(fp16_out.size() / 2);
    ToFp32(ElementType::kFp16, fp16_out.data(), out.data(), out.size());
    return out;
  }
  std::vector<char> bf16, fp16_out;
  std::shared_ptr<InferTask> task;
  std::atomic<int> calls{0};
  absl::Status status;
};

TEST(Batcher, ConvertsBf16AndFp16BothWays) {
  Recorder rec;
  const int64_t tokens = 11;  // two batches of 8 rows: split and reassembled
  std::vector<float> values(tokens * kHidden);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 3.0f;
  Bf16InFp16Out req(values, tokens);
  req.Run(Options(8), rec.Executor());
  ASSERT_EQ(req.calls, 1);
  ASSERT_TRUE(req.status.ok()) << req.status;
  const std::vector<float> out = req.Answer();
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(out[i], 2 * values[i]) << i;
}

// With executor_converts the executor gets each request's own rows and types (here a BF16
// request answered in FP16, split over two batches), and the batcher converts nothing.
TEST(Batcher, AnExecutorThatConvertsGetsTheRequestsOwnRowsAndTypes) {
  const int64_t tokens = 11;
  std::vector<float> values(tokens * kHidden);
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  for (float& v : values) v = dist(rng);
  Bf16InFp16Out req(values, tokens);
  std::vector<int64_t> offsets;  // each chunk's first row, from its input pointer
  bool types_kept = true;
  Batcher::Executor exec = [&](int, std::span<const worker::RowChunk> chunks) {
    for (const auto& c : chunks) {
      types_kept =
          types_kept && c.input_type == ElementType::kBf16 && c.output_type == ElementType::kFp16;
      offsets.push_back((static_cast<const char*>(c.input) - req.bf16.data()) / (2 * kHidden));
      std::vector<float> row(c.rows * kHidden);
      ToFp32(ElementType::kBf16, static_cast<const char*>(c.input), row.data(), row.size());
      for (float& v : row) v *= 2;
      FromFp32(ElementType::kFp16, row.data(), static_cast<char*>(c.output), row.size());
    }
    return absl::OkStatus();
  };
  BatchingOptions options = Options(8);
  options.executor_converts = true;
  req.Run(options, exec);
  ASSERT_EQ(req.calls, 1);
  ASSERT_TRUE(req.status.ok()) << req.status;
  EXPECT_TRUE(types_kept);
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 8}));
  const std::vector<float> out = req.Answer();
  std::vector<float> expect(values.size());
  // The FP16 of twice the BF16 of each value: what the executor wrote, nothing else.
  std::vector<float> widened(values.size());
  ToFp32(ElementType::kBf16, req.bf16.data(), widened.data(), widened.size());
  for (float& v : widened) v *= 2;
  std::vector<char> narrowed(values.size() * 2);
  FromFp32(ElementType::kFp16, widened.data(), narrowed.data(), widened.size());
  ToFp32(ElementType::kFp16, narrowed.data(), expect.data(), expect.size());
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(out[i], expect[i]) << i;
}

TEST(Batcher, ARequestCancelledMidwayIsAnsweredOnceAndItsRestIsNotComputed) {
  Gate gate;
  std::atomic<bool> cancel{false};
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(4, absl::ZeroDuration()), kModel, kLevels, gate.Executor());
    reqs.push_back(MakeRequest(40, 0));  // ten batches
    reqs.back()->task->cancelled = [&] { return cancel.load(); };
    ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    while (gate.batches() == 0) absl::SleepFor(absl::Milliseconds(1));
    cancel = true;
    gate.Open();
    WaitDone(reqs);
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(reqs[0]->calls, 1);
  EXPECT_EQ(reqs[0]->status.code(), absl::StatusCode::kCancelled);
  EXPECT_LE(gate.first_values.size(), 2u);  // the running batch and at most none after
}

TEST(Batcher, StopLetsFormedBatchesFinishAndFailsTheQueue) {
  Gate gate;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  Batcher b(Options(4, absl::ZeroDuration()), kModel, kLevels, gate.Executor());
  for (int i = 0; i < 5; ++i) {
    reqs.push_back(MakeRequest(4, 100.0f * i));
    ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
  }
  while (gate.batches() == 0) absl::SleepFor(absl::Milliseconds(1));
  std::thread opener([&] {
    absl::SleepFor(absl::Milliseconds(50));
    gate.Open();
  });
  b.Stop();
  opener.join();
  int ok = 0, unavailable = 0;
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    if (r->status.ok()) ++ok;
    if (r->status.code() == absl::StatusCode::kUnavailable) ++unavailable;
  }
  EXPECT_GE(ok, 1);  // the running batch (and the one formed behind it) finished
  EXPECT_EQ(ok + unavailable, 5);
}

TEST(Batcher, ReportsEveryBatchToTheObserver) {
  Recorder rec;
  std::mutex mu;
  int64_t observed_rows = 0;
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  {
    Batcher b(Options(8), kModel, kLevels, rec.Executor(),
              [&](int64_t rows, absl::Duration, absl::Duration, absl::Duration, absl::Duration) {
                std::lock_guard<std::mutex> lock(mu);
                observed_rows += rows;
              });
    for (int i = 0; i < 5; ++i) {
      reqs.push_back(MakeRequest(7, 0));
      ASSERT_TRUE(b.Enqueue(reqs.back()->task).ok());
    }
    WaitDone(reqs);
  }
  EXPECT_EQ(observed_rows, 35);
}

// Requests split over several batches while the "weights" (a factor the executor applies)
// are swapped between requests 10 times: each answer has one factor throughout, every
// request is answered, and a swap never runs while a batch does.
TEST(Batcher, RunBetweenRequestsNeverSplitsAnAnswer) {
  std::atomic<int> factor{1};
  std::atomic<bool> in_batch{false};
  std::atomic<int> overlaps{0};
  Batcher::Executor executor = [&](int, std::span<const worker::RowChunk> chunks) {
    in_batch.store(true);
    const float f = static_cast<float>(factor.load());
    for (const auto& c : chunks) {
      for (int64_t i = 0; i < c.rows * kHidden; ++i) c.fp32_output()[i] = f * c.fp32_input()[i];
    }
    absl::SleepFor(absl::Microseconds(200));
    in_batch.store(false);
    return absl::OkStatus();
  };
  std::vector<std::unique_ptr<FakeRequest>> reqs;
  std::mt19937 rng(std::random_device{}());
  {
    Batcher b(Options(8, absl::ZeroDuration()), kModel, kLevels, executor);
    std::atomic<bool> done{false};
    std::thread client([&] {
      for (int i = 0; i < 300; ++i) {
        reqs.push_back(MakeRequest(1 + rng() % 19, 100.0f * (i + 1)));
        while (!b.Enqueue(reqs.back()->task).ok()) absl::SleepFor(absl::Microseconds(50));
        if (i % 3 == 0) absl::SleepFor(absl::Microseconds(100));
      }
      done.store(true);
    });
    for (int swap = 0; swap < 10; ++swap) {
      absl::SleepFor(absl::Milliseconds(2));
      ASSERT_TRUE(b.RunBetweenRequests([&] {
                     if (in_batch.load()) overlaps.fetch_add(1);
                     factor.fetch_add(1);
                     return absl::OkStatus();
                   }).ok());
    }
    // The barrier's own status comes back to its caller.
    EXPECT_EQ(b.RunBetweenRequests([] { return absl::InternalError("no"); }).code(),
              absl::StatusCode::kInternal);
    client.join();
    WaitDone(reqs);
    b.Stop();
    EXPECT_EQ(b.RunBetweenRequests([] { return absl::OkStatus(); }).code(),
              absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(factor.load(), 11);
  std::set<float> factors_seen;
  for (const auto& r : reqs) {
    ASSERT_EQ(r->calls, 1);
    ASSERT_TRUE(r->status.ok()) << r->status;
    const float f = r->out[0] / r->in[0];
    factors_seen.insert(f);
    for (size_t i = 0; i < r->in.size(); ++i) {
      ASSERT_EQ(r->out[i], f * r->in[i])
          << "row " << i / kHidden << " of a " << r->in.size() / kHidden
          << "-row request has another factor than row 0";
    }
  }
  EXPECT_GE(factors_seen.size(), 3u);  // the swaps happened while requests flowed
}

}  // namespace
}  // namespace epserve::server
