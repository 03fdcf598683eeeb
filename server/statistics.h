// Cumulative per-model statistics in the shape of Triton's ModelStatistics (what
// perf_analyzer and tritonclient's get_inference_statistics read). A "batch size" is a
// batch's number of token rows. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpc_service.pb.h"
#include "server/batcher.h"

namespace epserve::server {

class Statistics {
 public:
  // One answered inference request (of a served model): its status, time from arrival to
  // answer and, on success, where that time went.
  void ObserveRequest(const absl::Status& status, absl::Duration total, const TaskTimes& times);
  // One batch run by the workers.
  void ObserveBatch(int64_t rows, absl::Duration input, absl::Duration infer,
                    absl::Duration output);
  // Fills `out` (name and version are the caller's).
  void Fill(inference::ModelStatistics* out) const;

 private:
  struct Duration {
    uint64_t count = 0;
    uint64_t ns = 0;
    void Add(absl::Duration d) {
      ++count;
      ns += static_cast<uint64_t>(absl::ToInt64Nanoseconds(d));
    }
  };
  struct BatchStats {
    Duration input, infer, output;
  };
  mutable std::mutex mu_;
  uint64_t last_inference_ms_ = 0;                            // guarded by mu_
  uint64_t inference_count_ = 0;                              // guarded by mu_
  uint64_t execution_count_ = 0;                              // guarded by mu_
  Duration success_, fail_, queue_, input_, infer_, output_;  // guarded by mu_
  std::map<int64_t, BatchStats> batches_;                     // by rows; guarded by mu_
};

}  // namespace epserve::server
