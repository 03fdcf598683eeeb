#include "server/health.h"

#include <optional>

namespace epserve::server {
namespace {

using grpc::health::v1::HealthCheckResponse;

bool KnownService(const std::string& name) {
  return name.empty() || name == "inference.GRPCInferenceService";
}

}  // namespace

// One Watch call: writes the status now and after each change, one write at a time (a
// change during a write is sent after it, only the latest). Deletes itself in OnDone.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService& owner, bool known) : owner_(owner), known_(known) {}

  // Queues `status` for writing (or ends the call when `finish`).
  void Send(Status status, bool finish) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    if (finish) {
      finish_ = true;
    } else {
      pending_ = known_ ? status : HealthCheckResponse::SERVICE_UNKNOWN;
    }
    Pump();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) finish_ = true;
    Pump();
  }
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    finish_ = true;
    Pump();
  }
  void OnDone() override {
    owner_.Unregister(this);
    delete this;
  }

 private:
  void Pump() {  // holds mu_
    if (writing_ || finished_) return;
    if (pending_) {
      response_.set_status(*pending_);
      pending_.reset();
      writing_ = true;
      StartWrite(&response_);
    } else if (finish_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  HealthService& owner_;
  const bool known_;
  std::mutex mu_;
  HealthCheckResponse response_;  // guarded by mu_ while no write is in flight
  std::optional<Status> pending_;
  bool writing_ = false;
  bool finish_ = false;    // end the call once nothing is left to write
  bool finished_ = false;  // Finish called
};

HealthService::~HealthService() { Shutdown(); }

void HealthService::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  serving_ = serving;
  for (Watcher* w : watchers_) {
    w->Send(serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING, false);
  }
}

void HealthService::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shut_down_ = true;
  for (Watcher* w : watchers_) w->Send(HealthCheckResponse::NOT_SERVING, true);
}

void HealthService::Unregister(Watcher* w) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.erase(w);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx,
                                               const grpc::health::v1::HealthCheckRequest* req,
                                               HealthCheckResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (!KnownService(req->service())) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + req->service() + "'"));
    return reactor;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    resp->set_status(serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext*, const grpc::health::v1::HealthCheckRequest* req) {
  auto* w = new Watcher(*this, KnownService(req->service()));
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.insert(w);
  w->Send(serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING, false);
  if (shut_down_) w->Send(HealthCheckResponse::NOT_SERVING, true);
  return w;
}

}  // namespace epserve::server
