#include "server/service.h"

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"

namespace epserve::server {
namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

}  // namespace

absl::Status InferenceService::CheckModel(const std::string& name,
                                          const std::string& version) const {
  if (name != signature_.name) {
    return absl::NotFoundError(
        absl::StrCat("unknown model '", name, "'; this server serves '", signature_.name, "'"));
  }
  if (!version.empty() && version != "1") {
    return absl::NotFoundError(
        absl::StrCat("unknown version '", version, "' of model '", name, "'"));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceService::ServerLive(grpc::CallbackServerContext* ctx,
                                                       const inference::ServerLiveRequest*,
                                                       inference::ServerLiveResponse* resp) {
  resp->set_live(true);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerReady(grpc::CallbackServerContext* ctx,
                                                        const inference::ServerReadyRequest*,
                                                        inference::ServerReadyResponse* resp) {
  resp->set_ready(ready());
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelReady(grpc::CallbackServerContext* ctx,
                                                       const inference::ModelReadyRequest* req,
                                                       inference::ModelReadyResponse* resp) {
  absl::Status s = CheckModel(req->name(), req->version());
  if (s.ok()) resp->set_ready(ready());
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* InferenceService::ServerMetadata(
    grpc::CallbackServerContext* ctx, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* resp) {
  resp->set_name("epserve");
  resp->set_version(EPSERVE_VERSION);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelMetadata(
    grpc::CallbackServerContext* ctx, const inference::ModelMetadataRequest* req,
    inference::ModelMetadataResponse* resp) {
  absl::Status s = CheckModel(req->name(), req->version());
  if (!s.ok()) return Reply(ctx, s);
  resp->set_name(signature_.name);
  resp->add_versions("1");
  resp->set_platform("epserve_moe");
  for (auto* t : {resp->add_inputs(), resp->add_outputs()}) {
    t->set_datatype("FP32");
    t->add_shape(-1);
    t->add_shape(signature_.hidden_size);
  }
  resp->mutable_inputs(0)->set_name(kInputName);
  resp->mutable_outputs(0)->set_name(kOutputName);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelInfer(grpc::CallbackServerContext* ctx,
                                                       const inference::ModelInferRequest* req,
                                                       inference::ModelInferResponse* resp) {
  const absl::Time start = absl::Now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<ParsedInfer> parsed = ParseInfer(*req, signature_);
  if (!parsed.ok()) {
    metrics_.ObserveRequest(parsed.status().code(), absl::Now() - start, absl::ZeroDuration(), 0);
    reactor->Finish(ToGrpcStatus(parsed.status()));
    return reactor;
  }
  resp->set_model_name(signature_.name);
  resp->set_model_version("1");
  resp->set_id(req->id());
  auto* out = resp->add_outputs();
  out->set_name(kOutputName);
  out->set_datatype("FP32");
  out->add_shape(parsed->num_tokens);
  out->add_shape(signature_.hidden_size);
  std::string* raw = resp->add_raw_output_contents();
  raw->resize(static_cast<size_t>(parsed->num_tokens * signature_.hidden_size) * sizeof(float));

  auto task = std::make_shared<InferTask>();
  task->layer_pos = parsed->layer_pos;
  task->num_tokens = parsed->num_tokens;
  task->input = parsed->input;
  task->output = raw->data();
  task->enqueued = start;
  if (const auto d = ctx->deadline(); d != std::chrono::system_clock::time_point::max()) {
    task->deadline = absl::FromChrono(d);
  }
  task->cancelled = [ctx] { return ctx->IsCancelled(); };
  task->done = [this, reactor, start, tokens = parsed->num_tokens](absl::Status s,
                                                                   absl::Duration queue_time) {
    metrics_.ObserveRequest(s.code(), absl::Now() - start, queue_time, tokens);
    reactor->Finish(ToGrpcStatus(s));
  };
  if (absl::Status s = batcher_.Enqueue(task); !s.ok()) {
    metrics_.ObserveRequest(s.code(), absl::Now() - start, absl::ZeroDuration(), 0);
    reactor->Finish(ToGrpcStatus(s));
  }
  return reactor;
}

}  // namespace epserve::server
