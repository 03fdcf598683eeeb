// Prometheus metrics of the whole cluster, exported by rank 0 on one /metrics endpoint.
// Workers' stage timings reach rank 0 with each batch (worker::BatchTrace).
// Thread-safe: every method may be called from any thread. Series are created up front,
// so recording takes no lock shared by all requests and allocates nothing.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/metrics_http.h"
#include "server/served_model.h"
#include "worker/coordinator.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace epserve::server {

class Metrics {
 public:
  // Registers every series of `model` (its workers, experts and served layers), labelled
  // with `model_name`, and serves them as `http` says (its address: port 0 picks a free one).
  // `queue_capacity_tokens` is --max-queue-tokens. Configuration time.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(const MetricsHttpOptions& http,
                                                        const std::string& model_name,
                                                        const ServedModel& model,
                                                        int64_t queue_capacity_tokens);
  ~Metrics();

  std::string bound_address() const { return bound_address_; }

  // A request arrived (epserve_inflight_requests); ObserveRequest ends it.
  void RequestStarted();
  // One answered request: its code, time from arrival to answer, time queued, token rows.
  void ObserveRequest(absl::StatusCode code, absl::Duration latency, absl::Duration queue_time,
                      int64_t tokens);
  // One finished batch of `rows` rows of served layer number `layer_pos`.
  void ObserveBatch(const worker::BatchTrace& trace, int64_t rows, int layer_pos = 0);
  // Rank 0's time answering one batch's requests.
  void ObserveRespond(absl::Duration duration);
  void SetQueueTokens(int64_t tokens);
  void SetWorkersReady(int workers);
  void SetWorkersLost(int workers);
  void SetHeapBytes(int64_t bytes);
  // Bytes of requests and answers held for calls (MemoryBudget), and its bound.
  void SetHeldBytes(int64_t bytes);
  void SetHeldBytesLimit(int64_t bytes);
  // A call the server closed because its client did not take its answer: reason is
  // "answer_timeout" or "memory_pressure".
  void ObserveCallClosed(const char* reason);
  // A gRPC connection the stream guard shut down: reason "stream_limit" (more open streams
  // than the bound) or "connection_limit".
  void ObserveConnectionClosed(const char* reason);
  // Open gRPC connections (past the HTTP/2 handshake), about once a second.
  void SetGrpcConnections(int64_t connections);
  // Rows a batch left out before computing them because their request was cancelled, had
  // passed its deadline or had already failed.
  void ObserveSkippedRows(absl::StatusCode code, int64_t rows);
  // A weight swap (RepositoryModelLoad with new weights): its outcome and how long it took.
  void ObserveWeightSwap(absl::StatusCode code, absl::Duration took);
  // A rebalance (EplbOptions): "done" (how long it took, the weight bytes the workers
  // loaded, the new placements), "skipped" (the gain was too small) or "failed".
  void ObserveRebalance(const char* outcome, absl::Duration took, int64_t bytes,
                        const std::vector<worker::ExpertPlacement>* placements);
  // epserve_expert_replicas from the placement of each served layer (at start, after a
  // rebalance, after a worker's death: the survivors' copies).
  void SetReplicas(const std::vector<worker::ExpertPlacement>& placements);

 private:
  Metrics() = default;
  // Start's parts: each registers one family of series into registry_.
  void RegisterRequestMetrics(const std::string& model_name);
  void RegisterBatchMetrics(const ServedModel& model);
  void RegisterStageMetrics(const ServedModel& model);
  void RegisterRebalanceMetrics();
  void RegisterStateMetrics(const ServedModel& model, int64_t queue_capacity_tokens);
  void RegisterProtectionMetrics();
  // epserve_expert_balancedness looks this far back.
  static constexpr int kBalanceWindowBatches = 64;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  std::array<prometheus::Counter*, kNumHttpEvents> http_events_{};
  prometheus::Gauge* http_open_ = nullptr;
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
  prometheus::Histogram* respond_seconds_ = nullptr;
  std::array<prometheus::Counter*, 2> exchange_bytes_{};  // dispatch, combine
  prometheus::Counter* client_rows_ = nullptr;
  // Per-entry counts (experts, workers) of the last kBalanceWindowBatches batches of a layer:
  // a ring of batches and the sums over it.
  class BalanceWindow {
   public:
    explicit BalanceWindow(size_t entries)
        : ring_(kBalanceWindowBatches, std::vector<int64_t>(entries, 0)), sum_(entries, 0) {}
    // Replaces the oldest batch with `counts` (entries past its end count 0); the window's
    // mean / max over the entries `counted` has (all where empty: a dead worker's is not),
    // or nothing while every such entry is 0.
    std::optional<double> Add(std::span<const int64_t> counts,
                              const std::vector<bool>& counted = {});

   private:
    std::vector<std::vector<int64_t>> ring_;
    std::vector<int64_t> sum_;
    size_t next_ = 0;
  };
  // Per served layer: per-expert token counters, per-worker pair counters, copies per expert,
  // the balancedness gauges and their windows.
  struct LayerSeries {
    std::vector<prometheus::Counter*> expert_tokens;
    std::vector<prometheus::Counter*> worker_pairs;
    std::vector<prometheus::Gauge*> replicas;  // per expert
    prometheus::Gauge* balancedness = nullptr;
    prometheus::Gauge* worker_balancedness = nullptr;
    BalanceWindow experts{0}, workers{0};
  };
  // The expert load profile of every served layer since start (server/eplb_profile.h), JSON.
  std::string ExpertLoadProfile() const;
  std::vector<int> layer_ids_;
  int num_experts_ = 0;
  std::map<std::string, prometheus::Counter*> rebalances_;
  prometheus::Gauge* rebalance_seconds_ = nullptr;
  prometheus::Counter* rebalance_bytes_ = nullptr;
  std::vector<LayerSeries> layers_;  // ObserveBatch runs on one thread at a time
  std::mutex balance_mu_;            // guards the windows
  prometheus::Gauge* inflight_ = nullptr;
  prometheus::Gauge* queue_tokens_ = nullptr;
  prometheus::Gauge* workers_ready_ = nullptr;
  prometheus::Gauge* workers_lost_ = nullptr;
  prometheus::Gauge* heap_bytes_ = nullptr;
  prometheus::Gauge* held_bytes_ = nullptr;
  prometheus::Gauge* held_bytes_limit_ = nullptr;
  prometheus::Counter* closed_answer_timeout_ = nullptr;
  prometheus::Counter* closed_memory_pressure_ = nullptr;
  prometheus::Counter* closed_stream_limit_ = nullptr;
  prometheus::Counter* closed_connection_limit_ = nullptr;
  prometheus::Counter* swaps_ok_ = nullptr;
  prometheus::Counter* swaps_failed_ = nullptr;
  prometheus::Gauge* swap_seconds_ = nullptr;
  prometheus::Gauge* grpc_connections_ = nullptr;
  std::array<prometheus::Counter*, 3> skipped_rows_{};  // cancelled, deadline, failed
};

}  // namespace epserve::server
