// Bytes of requests and answers that rank 0 holds for its calls, against one bound that no
// client can get around (--max-inflight-bytes): a request is charged its message and its
// answer's bytes when it is accepted and released when gRPC has sent the answer or the call
// ended without it. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>

namespace epserve::server {

class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit) : limit_(limit) {}

  // Charges `bytes` when they fit under the limit; false (nothing charged) otherwise.
  bool TryCharge(int64_t bytes) {
    int64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (used + bytes > limit_) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

}  // namespace epserve::server
