// grpc.health.v1.Health: SERVING while the front-end is ready (every worker loaded and
// answering, not shutting down), NOT_SERVING otherwise. Service names: "" (the server) and
// "inference.GRPCInferenceService"; any other is NOT_FOUND (Check) or SERVICE_UNKNOWN
// (Watch). Never needs the bearer token. Thread-safe.
#pragma once

#include <mutex>
#include <set>

#include "health.grpc.pb.h"

namespace epserve::server {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  ~HealthService() override;

  // Sets the status and tells every watcher.
  void SetServing(bool serving);
  // Ends every Watch (before the gRPC server shuts down); later Watches end at once.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

 private:
  class Watcher;
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;
  void Unregister(Watcher* w);

  std::mutex mu_;
  bool serving_ = false;         // guarded by mu_
  bool shut_down_ = false;       // guarded by mu_
  std::set<Watcher*> watchers_;  // guarded by mu_
};

}  // namespace epserve::server
