// Prometheus metrics of the whole cluster, exported by rank 0 on one /metrics endpoint.
// Workers' stage timings reach rank 0 with each batch (worker::BatchTrace).
// Thread-safe: every method may be called from any thread. Series are created up front,
// so recording takes no lock shared by all requests and allocates nothing.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/coordinator.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace epserve::server {

class Metrics {
 public:
  // Binds `address` ("host:port", port 0 picks a free one). Configuration time.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(const std::string& address,
                                                        const std::string& model_name,
                                                        int num_workers, int num_experts);
  ~Metrics();

  std::string bound_address() const { return bound_address_; }

  void ObserveRequest(absl::StatusCode code, absl::Duration latency, absl::Duration queue_time,
                      int64_t tokens);
  void ObserveBatch(const worker::BatchTrace& trace, int64_t rows);
  void SetQueueTokens(int64_t tokens);
  void SetWorkersReady(int workers);
  void SetHeapBytes(int64_t bytes);

 private:
  Metrics() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string bound_address_;
  int num_workers_ = 0;
  static constexpr int kNumCodes = 17;
  std::array<prometheus::Counter*, kNumCodes> requests_{};
  std::array<prometheus::Histogram*, kNumCodes> request_seconds_{};
  prometheus::Histogram* queue_seconds_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Histogram* scatter_seconds_ = nullptr;
  prometheus::Histogram* gather_seconds_ = nullptr;
  std::vector<std::array<prometheus::Histogram*, worker::kNumWorkerStages>> stage_seconds_;
  std::vector<prometheus::Counter*> expert_tokens_;
  prometheus::Gauge* queue_tokens_ = nullptr;
  prometheus::Gauge* workers_ready_ = nullptr;
  prometheus::Gauge* heap_bytes_ = nullptr;
};

}  // namespace epserve::server
