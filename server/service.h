// inference.GRPCInferenceService (KServe v2, Triton's field numbers) over the dynamic
// batcher. The repository, shared-memory, trace and log RPCs answer UNIMPLEMENTED.
// Thread-safe: gRPC calls the handlers from its own threads.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "grpc_service.grpc.pb.h"
#include "server/auth.h"
#include "server/batcher.h"
#include "server/metrics.h"
#include "server/statistics.h"
#include "server/validation.h"

namespace epserve::server {

struct ServiceOptions {
  ModelSignature signature;
  int num_workers = 1;
  int top_k = 1;               // width of the topk_ids and topk_weights outputs
  std::string device = "cpu";  // the workers' OpenCL device choice, reported in ModelConfig
  int64_t max_batch_tokens = 256;
  absl::Duration max_queue_delay = absl::ZeroDuration();
  int64_t max_queue_tokens = 65536;
  // Requests of one ModelStreamInfer stream read but not yet answered; at the bound the
  // server stops reading that stream until an answer is written.
  int max_stream_inflight = 64;
};

class InferenceService final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `batcher`, `metrics` and `statistics` outlive the service; `metrics` may be null.
  InferenceService(ServiceOptions options, Batcher& batcher, Metrics* metrics,
                   Statistics& statistics, std::shared_ptr<const Authenticator> auth);

  // Ready: workers loaded and answering, not shutting down. Live: the process answers.
  void set_ready(bool ready) { ready_.store(ready); }
  bool ready() const { return ready_.load(); }

  // Validates `request`, pre-sizes `response` and queues the request. On OK, `done` is
  // called exactly once (from a batcher thread) when the response is complete or failed;
  // `request` and `response` must live until then. On error `done` is not called.
  absl::Status Submit(const inference::ModelInferRequest& request,
                      inference::ModelInferResponse* response, absl::Time start,
                      absl::Time deadline, std::function<bool()> cancelled,
                      std::function<void(absl::Status)> done);

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* ctx,
                                       const inference::ServerLiveRequest* req,
                                       inference::ServerLiveResponse* resp) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* ctx,
                                        const inference::ServerReadyRequest* req,
                                        inference::ServerReadyResponse* resp) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* ctx,
                                       const inference::ModelReadyRequest* req,
                                       inference::ModelReadyResponse* resp) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* ctx,
                                           const inference::ServerMetadataRequest* req,
                                           inference::ServerMetadataResponse* resp) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* ctx,
                                          const inference::ModelMetadataRequest* req,
                                          inference::ModelMetadataResponse* resp) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx,
                                       const inference::ModelInferRequest* req,
                                       inference::ModelInferResponse* resp) override;
  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
  ModelStreamInfer(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* ctx,
                                        const inference::ModelConfigRequest* req,
                                        inference::ModelConfigResponse* resp) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* ctx,
                                            const inference::ModelStatisticsRequest* req,
                                            inference::ModelStatisticsResponse* resp) override;

#define EPSERVE_UNIMPLEMENTED_RPC(Name)                                      \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* ctx,           \
                                 const inference::Name##Request* req,        \
                                 inference::Name##Response* resp) override { \
    return Unimplemented(ctx, #Name);                                        \
  }
  EPSERVE_UNIMPLEMENTED_RPC(RepositoryIndex)
  EPSERVE_UNIMPLEMENTED_RPC(RepositoryModelLoad)
  EPSERVE_UNIMPLEMENTED_RPC(RepositoryModelUnload)
  EPSERVE_UNIMPLEMENTED_RPC(SystemSharedMemoryStatus)
  EPSERVE_UNIMPLEMENTED_RPC(SystemSharedMemoryRegister)
  EPSERVE_UNIMPLEMENTED_RPC(SystemSharedMemoryUnregister)
  EPSERVE_UNIMPLEMENTED_RPC(CudaSharedMemoryStatus)
  EPSERVE_UNIMPLEMENTED_RPC(CudaSharedMemoryRegister)
  EPSERVE_UNIMPLEMENTED_RPC(CudaSharedMemoryUnregister)
  EPSERVE_UNIMPLEMENTED_RPC(TraceSetting)
  EPSERVE_UNIMPLEMENTED_RPC(LogSettings)
#undef EPSERVE_UNIMPLEMENTED_RPC

 private:
  class StreamInfer;
  absl::Status CheckModel(const std::string& name, const std::string& version) const;
  grpc::ServerUnaryReactor* Unimplemented(grpc::CallbackServerContext* ctx, const char* rpc);
  void BuildModelConfig();

  const ServiceOptions options_;
  Batcher& batcher_;
  Metrics* const metrics_;
  Statistics& statistics_;
  const std::shared_ptr<const Authenticator> auth_;
  inference::ModelConfig model_config_;
  std::atomic<bool> ready_{false};
};

}  // namespace epserve::server
