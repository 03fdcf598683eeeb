// The batcher tests' fakes: requests whose rows prove where they came from, an executor that
// records its batches, and waits with deadlines.
#pragma once

#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "server/batcher.h"

namespace epserve::server::batcher_test {

constexpr int64_t kHidden = 4;

// A request whose rows are its own row indices plus an offset, answered by an executor
// that doubles every value, so each output row proves where it came from.
struct FakeRequest {
  std::vector<float> in, out;
  std::shared_ptr<InferTask> task;
  // Written by the batcher's thread: status first, then calls (release); read after calls.
  std::atomic<int> calls{0};
  absl::Status status;
};

inline std::unique_ptr<FakeRequest> MakeRequest(int64_t tokens, float offset, int layer_pos = 0) {
  auto r = std::make_unique<FakeRequest>();
  r->in.resize(tokens * kHidden);
  for (size_t i = 0; i < r->in.size(); ++i) r->in[i] = offset + static_cast<float>(i);
  r->out.assign(tokens * kHidden, NAN);
  r->task = std::make_shared<InferTask>();
  r->task->layer_pos = layer_pos;
  r->task->num_tokens = tokens;
  r->task->input = reinterpret_cast<const char*>(r->in.data());
  r->task->output = reinterpret_cast<char*>(r->out.data());
  r->task->enqueued = absl::Now();
  FakeRequest* raw = r.get();
  r->task->done = [raw](absl::Status s, const TaskTimes&) {
    raw->status = std::move(s);
    raw->calls.fetch_add(1, std::memory_order_release);
  };
  return r;
}

struct Recorder {
  std::mutex mu;
  std::vector<int64_t> batch_rows;
  std::vector<int> layers;
  absl::Status fail_with;
  Batcher::Executor Executor() {
    return [this](int layer_pos, std::span<const worker::RowChunk> chunks) {
      int64_t rows = 0;
      for (const auto& c : chunks) {
        for (int64_t i = 0; i < c.rows * kHidden; ++i) c.fp32_output()[i] = 2 * c.fp32_input()[i];
        rows += c.rows;
      }
      std::lock_guard<std::mutex> lock(mu);
      batch_rows.push_back(rows);
      layers.push_back(layer_pos);
      return fail_with;
    };
  }
};

inline BatchingOptions Options(int64_t max_batch, absl::Duration delay = absl::Milliseconds(5)) {
  BatchingOptions o;
  o.max_batch_tokens = max_batch;
  o.max_queue_delay_us = absl::ToInt64Microseconds(delay);
  o.max_queue_tokens = 1000;
  return o;
}

// Two served layers of H = kHidden, three priority levels.
inline const ServedModel kModel{.hidden_size = kHidden, .layers = {0, 1}};
constexpr int64_t kLevels = 3;

inline void WaitDone(const std::vector<std::unique_ptr<FakeRequest>>& reqs) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (const auto& r : reqs) {
    if (r == nullptr) continue;  // not sent yet
    while (r->calls.load(std::memory_order_acquire) == 0 && absl::Now() < deadline)
      absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace epserve::server::batcher_test
