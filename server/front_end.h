// Rank 0: the gRPC service, the dynamic batcher, the metrics endpoint and the hand-off of
// batches to the workers through the coordinator.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "model/moe_config.h"
#include "server/batcher.h"
#include "server/metrics.h"
#include "server/service.h"
#include "worker/coordinator.h"

namespace epserve::server {

struct FrontEndOptions {
  std::string model_name = "moe";
  std::string grpc_address = "127.0.0.1:8001";
  std::string metrics_address = "127.0.0.1:8002";
  std::string ready_file;
  int64_t max_batch_tokens = 256;
  absl::Duration max_queue_delay = absl::Microseconds(500);
  int64_t max_queue_tokens = 65536;
  int64_t max_request_bytes = 64 << 20;
  absl::Duration batch_timeout = absl::Seconds(60);
  absl::Duration drain_timeout = absl::Milliseconds(300);
};

// Not thread-safe: one thread starts and shuts it down.
class FrontEnd {
 public:
  // Binds both addresses, starts serving and writes the ready file. The coordinator's
  // workers must be ready.
  static absl::StatusOr<std::unique_ptr<FrontEnd>> Start(const FrontEndOptions& options,
                                                         const model::ModelConfig& model,
                                                         worker::Coordinator& coordinator,
                                                         int64_t heap_bytes);
  ~FrontEnd();

  const std::string& grpc_address() const { return grpc_address_; }
  std::string metrics_address() const { return metrics_->bound_address(); }

  // Stops accepting requests and answers every accepted one (its result, or UNAVAILABLE if
  // its batch does not finish within drain_timeout), then stops the workers.
  absl::Status Shutdown();

 private:
  FrontEnd(FrontEndOptions options, worker::Coordinator& coordinator)
      : options_(std::move(options)), coordinator_(coordinator) {}
  absl::Status RunBatch(int layer_pos, std::span<const worker::RowChunk> chunks);

  const FrontEndOptions options_;
  worker::Coordinator& coordinator_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<InferenceService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string grpc_address_;
  bool shut_down_ = false;
};

// Writes {"grpc": "...", "metrics": "..."} to `path` (temporary file, then rename).
absl::Status WriteReadyFile(const std::string& path, const std::string& grpc_address,
                            const std::string& metrics_address);

}  // namespace epserve::server
