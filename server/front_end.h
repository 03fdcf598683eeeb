// Rank 0: the gRPC server (KServe v2 inference, grpc.health.v1, reflection), the dynamic
// batcher, the metrics endpoint and the hand-off of batches to the workers through the
// coordinator.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "model/moe_config.h"
#include "model/weights.h"
#include "server/auth.h"
#include "server/batcher.h"
#include "server/health.h"
#include "server/metrics.h"
#include "server/served_model.h"
#include "server/service.h"
#include "server/statistics.h"
#include "server/stream_guard.h"
#include "worker/coordinator.h"

namespace epserve::server {

// Every setting of the front-end, each the home of one flag (app/flags.cc binds the
// flags straight to these fields). Settings another component reads are grouped in that
// component's struct, which checks them (Validate, where it is defined) and which the
// component takes by const reference; the rest are the FrontEnd's own.
// Expert load balancing while serving: every `interval_batches` batches, rank 0 places each
// served layer's experts and redundant copies anew (worker/eplb.h) for the loads those
// batches brought, and, where that evens the workers' expected loads by at least `min_gain`
// (balancedness, mean / max), has the workers load the new layout beside the serving one
// (batches go on) and switches between two batches. Answers do not change with the placement
// (worker/exchange.h), so nothing waits for requests to finish.
struct EplbOptions {
  int64_t interval_batches = 0;  // --eplb-interval; 0: off
  double min_gain = 0.05;        // --eplb-min-gain, in [0, 1]
  // --eplb-min-copies: copies of every expert each placement keeps (where the workers alive
  // have room), so that a worker's death leaves one of each (Coordinator, "A worker's death").
  int min_copies = 1;
};

struct FrontEndOptions {
  RequestOptions requests;     // server/validation.h: model name, request size, priorities
  BatchingOptions batching;    // server/batcher.h: batch size, queue delay and bound
  ServiceOptions service;      // server/service.h: stream window, memory budget, answer timeout
  StreamGuardOptions streams;  // server/stream_guard.h: streams per connection, connections
  // server/metrics_http.h: the /metrics endpoint, its address and connection bounds.
  MetricsHttpOptions metrics = {.address = "127.0.0.1:8002"};

  std::string grpc_address = "127.0.0.1:8001";
  std::string ready_file;
  // Message bounds. 0: derived from the model, max_request_tokens x H x 4 bytes (FP32, the
  // widest datatype) plus 64 KiB for names, parameters and the routing outputs
  // (EffectiveMessageBytes).
  int64_t max_request_bytes = 0;
  int64_t max_response_bytes = 0;
  // gRPC's own memory: buffers, calls, connections (a grpc::ResourceQuota; 0: derived). Under
  // pressure gRPC closes idle connections and then cancels calls.
  int64_t grpc_memory_quota = 0;
  // A connection must deliver HTTP/2's preface and SETTINGS within this.
  absl::Duration grpc_handshake_timeout = absl::Seconds(10);
  // A connection with no call for this long is closed (GRPC_ARG_MAX_CONNECTION_IDLE_MS); one
  // older than max_connection_age is closed after its calls finish (0: never).
  absl::Duration max_connection_idle = absl::Minutes(10);
  absl::Duration max_connection_age = absl::ZeroDuration();
  // A worker whose heartbeat stops this long (stopped, wedged) turns the server not ready
  // until it beats again (shm heap only; see Coordinator::StalledWorkers).
  absl::Duration worker_stall_timeout = absl::Seconds(3);
  // --host-copy-threads: rank 0's threads for a batch's row copies into and out of the heap
  // and its dtype conversions; 0: common::DefaultCopyThreads() (a quarter of the host's).
  int host_copy_threads = 0;
  // --respond-threads: threads that hand answers to gRPC (its serialisation of each answer);
  // 0: as many as host_copy_threads; 1: the completion thread answers itself.
  int respond_threads = 0;
  // Batches between rank 0 and the workers at once: 2 (the next batch's rows copied in while
  // the workers compute, the last one's output copied out while they compute the next) or 1.
  int batches_in_flight = 2;
  // The ranks of the job on rank 0's host, itself included (from the job, not a flag): where
  // the host has threads to spare for them (common::ThreadsToSpare) the executor looks at a
  // running batch's end every few microseconds, else every 50 us at most
  // (BatchingOptions::end_poll).
  int ranks_on_host = 1;
  // Keepalive (gRPC channel arguments of the server).
  absl::Duration keepalive_time = absl::Hours(2);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  bool keepalive_permit_without_calls = false;
  absl::Duration http2_min_recv_ping_interval = absl::Minutes(5);
  int http2_max_ping_strikes = 2;
  // Security. TLS when cert and key are set; mutual TLS when client_ca is set too.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string auth_token_file;
  bool reflection = true;
  // Shutdown and worker waits.
  absl::Duration batch_timeout = absl::Seconds(60);
  // How long the workers may take to load new weights (RepositoryModelLoad, a rebalance).
  absl::Duration weight_swap_timeout = absl::Minutes(10);
  EplbOptions eplb;
  absl::Duration drain_timeout = absl::Milliseconds(300);

  // Every group's Validate, the bounds between groups and the front-end's own: the first
  // INVALID_ARGUMENT, naming the flag and its bound. Once, before anything is started.
  absl::Status Validate() const;
};

// Not thread-safe: one thread starts and shuts it down.
class FrontEnd {
 public:
  // Binds both addresses, starts serving and writes the ready file. `options` must be valid
  // (FrontEndOptions::Validate). The coordinator's workers, on `device` (--device), must be
  // ready.
  // `open_model` (may be empty) opens the weights a RepositoryModelLoad names, as the
  // workers will (worker::WorkerOptions::open_model); `default_seed` is the seed used when
  // the load names none.
  using ModelOpener = std::function<absl::StatusOr<std::unique_ptr<model::WeightSource>>(
      const std::string& model, uint64_t seed)>;
  static absl::StatusOr<std::unique_ptr<FrontEnd>> Start(
      const FrontEndOptions& options, const model::ModelConfig& model, const std::string& device,
      worker::Coordinator& coordinator, int64_t heap_bytes, ModelOpener open_model = nullptr,
      uint64_t default_seed = 0);
  // The same front-end over any executor (benchmarks, tests): `executor` runs each batch;
  // `options` valid as for Start.
  static absl::StatusOr<std::unique_ptr<FrontEnd>> StartWithExecutor(const FrontEndOptions& options,
                                                                     const ServedModel& model,
                                                                     Batcher::Executor executor);
  ~FrontEnd();

  const std::string& grpc_address() const { return grpc_address_; }
  std::string metrics_address() const { return metrics_->bound_address(); }

  // Drains: turns health NOT_SERVING and refuses new requests (UNAVAILABLE), answers every
  // accepted one (its result, or UNAVAILABLE if its batch does not finish within
  // drain_timeout), stops the gRPC server, then stops the workers.
  absl::Status Shutdown();

 private:
  FrontEnd(const FrontEndOptions& options, ServedModel served, worker::Coordinator* coordinator)
      : options_(options), served_(std::move(served)), coordinator_(coordinator) {}
  // With `pipelined` (the coordinator's halves) the batcher keeps two batches in flight.
  absl::Status Init(Batcher::Executor executor, Batcher::PipelinedExecutor pipelined = {});
  // Init's steps: the batcher over the executor (its threads, its observers), then the gRPC
  // server with the services on --grpc-address (grpc_address_ the port it got).
  void StartBatcher(Batcher::Executor executor, Batcher::PipelinedExecutor pipelined);
  absl::Status StartGrpc(const std::shared_ptr<grpc::ServerCredentials>& creds,
                         const Authenticator& auth);
  // Closes connections beyond the stream and connection bounds (server/stream_guard.h).
  void StartStreamGuard();
  // A batch through the coordinator: StartBatch copies its rows in (the batch before it may
  // still run), FinishBatch waits for it and reports it (metrics, the rebalancer's loads).
  absl::StatusOr<uint64_t> StartBatch(int layer_pos, std::span<const worker::RowChunk> chunks);
  absl::Status FinishBatch(uint64_t ticket, int layer_pos,
                           std::span<const worker::RowChunk> chunks);
  void SetReady(bool ready);
  // After a failed batch: not ready (health, ServerReady, epserve_workers_ready 0) when the
  // exchange itself failed (the coordinator is unhealthy), not when one batch did.
  void NotReadyIfExchangeFailed();
  // RepositoryModelLoad with new weights: checks them here (they open, same shape), has the
  // workers load them beside the serving ones while batches go on, then switches every
  // worker between requests (Batcher::RunBetweenRequests). One at a time.
  absl::Status SwapWeights(const std::string& model, std::optional<uint64_t> seed);
  // The stall monitor's thread: readiness follows the workers' heartbeats.
  void WatchHeartbeats(int num_workers);
  // The rebalancer's thread (EplbOptions), and one rebalance of the loads counted since the
  // last (under swap_mu_: never beside a weight swap).
  void RebalanceLoop();
  void Rebalance();
  // Stages `placements` (nullptr: the serving ones) with the weights of `model`, `seed` on
  // every worker beside the serving ones, then switches: between requests when
  // `between_requests` (the answers change), else between two batches. The bytes loaded
  // into *bytes.
  absl::Status StageAndSwitch(const std::string& model, uint64_t seed,
                              const std::vector<worker::ExpertPlacement>* placements,
                              bool between_requests, int64_t* bytes);

  // The settings and the model facts; the components refer to them (declared first, so they
  // outlive every component).
  const FrontEndOptions options_;
  const ServedModel served_;
  worker::Coordinator* const coordinator_;  // null with StartWithExecutor
  model::ModelConfig model_;                // with a coordinator: what the workers serve
  ModelOpener open_model_;                  // empty: no weight swaps
  uint64_t default_seed_ = 0;
  uint64_t serving_seed_ = 0;  // of the serving weights (under swap_mu_)
  std::mutex swap_mu_;         // one SwapWeights or Rebalance at a time
  std::mutex exec_mu_;         // held while the coordinator starts or finishes a batch, or a weight
                               // swap's step runs (which first finishes the batches in flight)
  int lost_seen_ = 0;          // workers lost as the metrics last showed (under exec_mu_)
  std::atomic<bool> stopping_{false};  // Shutdown began: weight swaps take no further step
  std::unique_ptr<Metrics> metrics_;
  Statistics statistics_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<InferenceService> service_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<StreamGuard> stream_guard_;  // stopped before server_ shuts down
  std::string grpc_address_;
  bool shut_down_ = false;
  // The stall monitor (with a coordinator): stopped first in Shutdown.
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;  // guarded by watch_mu_ (it stops the rebalancer too)
  std::thread watcher_;
  std::thread rebalancer_;
  // Per served layer, the pairs each expert took since the last rebalance, and the batches.
  std::mutex eplb_mu_;
  std::vector<std::vector<double>> eplb_load_;  // guarded by eplb_mu_
  int64_t eplb_batches_ = 0;                    // guarded by eplb_mu_
};

// Writes {"grpc": "...", "metrics": "..."} to `path` (temporary file, then rename).
absl::Status WriteReadyFile(const std::string& path, const std::string& grpc_address,
                            const std::string& metrics_address);

}  // namespace epserve::server
