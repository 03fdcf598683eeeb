// The direct start of a small request on an idle pipeline (BatchingOptions::direct_batch_tokens):
// the enqueuing thread starts its batch, nothing overtakes anything, starts and finishes stay
// in order, and every request is answered once, also when the start fails or the batcher
// stops meanwhile.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "server/batcher.h"
#include "tests/server/batcher_fakes.h"

namespace epserve::server {
namespace {

using namespace batcher_test;  // NOLINT: the fakes are this file's vocabulary

void Double(std::span<const worker::RowChunk> chunks) {
  for (const auto& c : chunks) {
    for (int64_t i = 0; i < c.rows * kHidden; ++i) c.fp32_output()[i] = 2 * c.fp32_input()[i];
  }
}

// A pipelined executor that doubles rows at start, records which thread started each batch
// and in which order batches start and finish, and can hold a start until let go.
struct Pipeline {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t next = 1;
  std::deque<uint64_t> running;  // in order of their starts
  std::map<uint64_t, std::thread::id> starter;
  int most_in_flight = 0;
  bool out_of_order = false;
  bool hold_starts = false;  // a start waits until this is false again
  int holding = 0;           // starts waiting now
  std::thread::id holder;    // the thread of the last start that waited
  bool fail_next_start = false;
  int start_us = 0;  // how long each start takes

  Batcher::PipelinedExecutor Executor() {
    Batcher::PipelinedExecutor e;
    e.start = [this](int, std::span<const worker::RowChunk> c) -> absl::StatusOr<uint64_t> {
      std::unique_lock<std::mutex> lock(mu);
      ++holding;
      holder = std::this_thread::get_id();
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(20), [&] { return !hold_starts; });
      --holding;
      if (fail_next_start) {
        fail_next_start = false;
        return absl::InternalError("start failed");
      }
      Double(c);
      // A start takes a while, as a copy into the heap does: rows arrive and batches form
      // meanwhile.
      lock.unlock();
      absl::SleepFor(absl::Microseconds(start_us));
      lock.lock();
      const uint64_t t = next++;
      running.push_back(t);
      starter[t] = std::this_thread::get_id();
      most_in_flight = std::max<int>(most_in_flight, static_cast<int>(running.size()));
      return t;
    };
    e.finished = [](uint64_t) { return true; };
    e.finish = [this](uint64_t t, int, std::span<const worker::RowChunk>) -> absl::Status {
      std::lock_guard<std::mutex> lock(mu);
      if (running.empty() || running.front() != t) out_of_order = true;
      if (!running.empty()) running.pop_front();
      return absl::OkStatus();
    };
    return e;
  }
  std::thread::id StarterOf(uint64_t t) {
    std::lock_guard<std::mutex> lock(mu);
    return starter.count(t) > 0 ? starter[t] : std::thread::id();
  }
};

BatchingOptions Direct(int64_t direct_tokens, int64_t max_batch = 16) {
  BatchingOptions o = Options(max_batch, absl::ZeroDuration());
  o.direct_batch_tokens = direct_tokens;
  o.respond_threads = 2;
  return o;
}

// Sends `tries` requests of 4 rows one at a time, a few milliseconds apart (the pipeline
// idle by then), and counts those whose batch this thread started.
int StartedHere(Batcher& b, Pipeline& p, int tries) {
  int here = 0;
  for (int i = 0; i < tries; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    std::vector<std::unique_ptr<FakeRequest>> one;
    one.push_back(MakeRequest(4, 10.0f * i));
    EXPECT_TRUE(b.Enqueue(one.back()->task).ok());
    WaitDone(one);
    EXPECT_EQ(one[0]->calls, 1);
    EXPECT_TRUE(one[0]->status.ok()) << one[0]->status;
    for (size_t j = 0; j < one[0]->in.size(); ++j) EXPECT_EQ(one[0]->out[j], 2 * one[0]->in[j]);
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.starter[p.next - 1] == std::this_thread::get_id()) ++here;
  }
  return here;
}

TEST(BatcherDirect, ASmallRequestOnAnIdlePipelineStartsOnTheEnqueuingThread) {
  Pipeline p;
  Batcher b(Direct(8), kModel, kLevels, p.Executor());
  // Every request finds the pipeline idle, but the first may come before the executor's
  // thread has said so.
  EXPECT_GE(StartedHere(b, p, 10), 9);
}

TEST(BatcherDirect, OffOrLargerRequestsGoThroughTheExecutor) {
  Pipeline off;
  Batcher b(Direct(0), kModel, kLevels, off.Executor());
  EXPECT_EQ(StartedHere(b, off, 5), 0);
  Pipeline small;
  Batcher c(Direct(3), kModel, kLevels, small.Executor());  // the requests have 4 rows
  EXPECT_EQ(StartedHere(c, small, 5), 0);
}

// Rounds of bursts: once the pipeline is idle, four threads enqueue requests of 1-20 rows
// at once, so that one starts directly (its start takes a while, as a copy into the heap
// does) while the others queue and form full batches. Every answer is right and given once,
// batches finish in the order they started, never more than two are in flight, and some
// started directly.
TEST(BatcherDirect, NothingOvertakesAndStartsAndFinishesStayInOrder) {
  constexpr int kRounds = 12, kSenders = 4, kEach = 5;
  Pipeline p;
  p.start_us = 300;
  std::vector<std::unique_ptr<FakeRequest>> reqs(kRounds * kSenders * kEach);
  std::mutex ids_mu;
  std::set<std::thread::id> sender_ids;
  {
    BatchingOptions options = Direct(8);
    options.max_queue_tokens = 1 << 20;  // every request is queued, however slow the starts
    Batcher b(options, kModel, kLevels, p.Executor());
    std::mt19937 seeds(std::random_device{}());
    for (int round = 0; round < kRounds; ++round) {
      absl::SleepFor(absl::Milliseconds(2));  // idle again
      std::vector<std::thread> senders;
      const absl::Time go = absl::Now() + absl::Milliseconds(1);
      for (int s = 0; s < kSenders; ++s) {
        senders.emplace_back([&, s, seed = seeds()] {
          {
            std::lock_guard<std::mutex> lock(ids_mu);
            sender_ids.insert(std::this_thread::get_id());
          }
          std::mt19937 rng(seed);
          absl::SleepFor(go - absl::Now());
          for (int i = 0; i < kEach; ++i) {
            const int at = (round * kSenders + s) * kEach + i;
            reqs[at] = MakeRequest(1 + rng() % 20, 1000.0f * at);
            ASSERT_TRUE(b.Enqueue(reqs[at]->task).ok());
          }
        });
      }
      for (auto& t : senders) t.join();
      WaitDone(reqs);
    }
  }
  int direct = 0;
  for (const auto& [t, id] : p.starter) direct += sender_ids.count(id);
  EXPECT_GT(direct, 0);
  for (const auto& r : reqs) {
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->calls, 1);
    EXPECT_TRUE(r->status.ok()) << r->status;
    for (size_t i = 0; i < r->in.size(); ++i) ASSERT_EQ(r->out[i], 2 * r->in[i]);
  }
  EXPECT_FALSE(p.out_of_order);
  EXPECT_LE(p.most_in_flight, 2);
  EXPECT_TRUE(p.running.empty());
}

TEST(BatcherDirect, AFailedDirectStartFailsItsRequestOnlyAndTheNextOneRuns) {
  Pipeline p;
  Batcher b(Direct(8), kModel, kLevels, p.Executor());
  ASSERT_GE(StartedHere(b, p, 3), 1);  // the executor is idle from here on between requests
  absl::SleepFor(absl::Milliseconds(5));
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.fail_next_start = true;
  }
  std::vector<std::unique_ptr<FakeRequest>> one;
  one.push_back(MakeRequest(4, 0));
  ASSERT_TRUE(b.Enqueue(one.back()->task).ok());
  WaitDone(one);
  EXPECT_EQ(one[0]->calls, 1);
  EXPECT_EQ(one[0]->status.code(), absl::StatusCode::kInternal) << one[0]->status;
  EXPECT_GE(StartedHere(b, p, 3), 1);
}

// Stop while a request's direct start is under way: Stop waits for the start, the batch
// runs, and its request is answered once, right.
TEST(BatcherDirect, StopWhileARequestStartsDirectlyAnswersIt) {
  Pipeline p;
  auto b = std::make_unique<Batcher>(Direct(8), kModel, kLevels, p.Executor());
  ASSERT_GE(StartedHere(*b, p, 3), 1);
  bool stopped_during_start = false;
  for (int attempt = 0; attempt < 20 && !stopped_during_start; ++attempt) {
    absl::SleepFor(absl::Milliseconds(5));
    auto let_go = [&p] {
      std::lock_guard<std::mutex> lock(p.mu);
      p.hold_starts = false;
      p.cv.notify_all();
    };
    {
      std::lock_guard<std::mutex> lock(p.mu);
      p.hold_starts = true;
    }
    std::vector<std::unique_ptr<FakeRequest>> one;
    one.push_back(MakeRequest(4, 7.0f));
    std::thread::id sender_id;
    std::mutex id_mu;
    std::thread sender([&] {
      {
        std::lock_guard<std::mutex> lock(id_mu);
        sender_id = std::this_thread::get_id();
      }
      EXPECT_TRUE(b->Enqueue(one[0]->task).ok());
    });
    bool direct;
    {
      std::unique_lock<std::mutex> lock(p.mu);
      ASSERT_TRUE(p.cv.wait_for(lock, std::chrono::seconds(20), [&] { return p.holding > 0; }));
      std::lock_guard<std::mutex> id_lock(id_mu);
      direct = p.holder == sender_id;
    }
    std::thread stopper;
    if (direct) {
      stopper = std::thread([&] { b->Stop(); });
      absl::SleepFor(absl::Milliseconds(20));  // Stop is under way, the start still held
      stopped_during_start = true;
    }
    let_go();
    sender.join();
    if (stopper.joinable()) stopper.join();
    WaitDone(one);
    EXPECT_EQ(one[0]->calls, 1);
    EXPECT_TRUE(one[0]->status.ok()) << one[0]->status;
    for (size_t i = 0; i < one[0]->in.size(); ++i) EXPECT_EQ(one[0]->out[i], 2 * one[0]->in[i]);
  }
  EXPECT_TRUE(stopped_during_start);
  b.reset();
}

// A weight swap between requests (RunBetweenRequests) runs while the executor is idle: a
// small request arriving meanwhile waits for it instead of starting directly beside it.
TEST(BatcherDirect, NoRequestStartsWhileABarrierRuns) {
  Pipeline p;
  std::atomic<bool> in_barrier{false};
  std::atomic<int> started_during{0};
  Batcher::PipelinedExecutor exec = p.Executor();
  auto start = exec.start;
  exec.start = [&](int layer, std::span<const worker::RowChunk> c) {
    if (in_barrier.load()) started_during.fetch_add(1);
    return start(layer, c);
  };
  std::vector<std::unique_ptr<FakeRequest>> reqs(200);
  {
    Batcher b(Direct(8), kModel, kLevels, exec);
    std::thread client([&] {
      std::mt19937 rng(std::random_device{}());
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i] = MakeRequest(1 + rng() % 6, 100.0f * i);
        ASSERT_TRUE(b.Enqueue(reqs[i]->task).ok());
        absl::SleepFor(absl::Microseconds(100 + rng() % 200));
      }
    });
    for (int swap = 0; swap < 10; ++swap) {
      absl::SleepFor(absl::Milliseconds(2));
      ASSERT_TRUE(b.RunBetweenRequests([&] {
                     in_barrier.store(true);
                     absl::SleepFor(absl::Milliseconds(2));
                     in_barrier.store(false);
                     return absl::OkStatus();
                   }).ok());
    }
    client.join();
    WaitDone(reqs);
  }
  for (const auto& r : reqs) {
    EXPECT_EQ(r->calls, 1);
    EXPECT_TRUE(r->status.ok()) << r->status;
  }
  EXPECT_EQ(started_during.load(), 0);
}

}  // namespace
}  // namespace epserve::server
