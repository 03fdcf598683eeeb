// inference.GRPCInferenceService (KServe v2) over the dynamic batcher. RPCs not overridden
// here answer UNIMPLEMENTED. Thread-safe: gRPC calls the handlers from its own threads.
#pragma once

#include <atomic>
#include <string>

#include "grpc_service.grpc.pb.h"
#include "model/moe_config.h"
#include "server/batcher.h"
#include "server/metrics.h"
#include "server/validation.h"

namespace epserve::server {

class InferenceService final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `batcher` and `metrics` outlive the service.
  InferenceService(ModelSignature signature, model::ModelConfig model, Batcher& batcher,
                   Metrics& metrics)
      : signature_(std::move(signature)),
        model_(std::move(model)),
        batcher_(batcher),
        metrics_(metrics) {}

  // Ready: workers loaded and not shutting down. Live: the process answers.
  void set_ready(bool ready) { ready_.store(ready); }
  bool ready() const { return ready_.load(); }

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

 private:
  absl::Status CheckModel(const std::string& name, const std::string& version) const;

  const ModelSignature signature_;
  const model::ModelConfig model_;
  Batcher& batcher_;
  Metrics& metrics_;
  std::atomic<bool> ready_{false};
};

}  // namespace epserve::server
