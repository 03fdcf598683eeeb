#include "server/front_end.h"

#include <grpcpp/server_builder.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace epserve::server {

absl::Status WriteReadyFile(const std::string& path, const std::string& grpc_address,
                            const std::string& metrics_address) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << "{\"grpc\": \"" << grpc_address << "\", \"metrics\": \"" << metrics_address << "\"}\n";
    if (!f.good()) return absl::UnavailableError(absl::StrCat("cannot write --ready-file ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<FrontEnd>> FrontEnd::Start(const FrontEndOptions& options,
                                                          const model::ModelConfig& model,
                                                          worker::Coordinator& coordinator,
                                                          int64_t heap_bytes) {
  std::unique_ptr<FrontEnd> fe(new FrontEnd(options, coordinator));
  const worker::ExchangeShape& shape = coordinator.shape();
  absl::StatusOr<std::unique_ptr<Metrics>> metrics = Metrics::Start(
      options.metrics_address, options.model_name, shape.num_workers, shape.num_experts);
  if (!metrics.ok()) return metrics.status();
  fe->metrics_ = *std::move(metrics);
  fe->metrics_->SetHeapBytes(heap_bytes);

  BatcherOptions batcher;
  batcher.max_batch_tokens = options.max_batch_tokens;
  batcher.max_queue_delay = options.max_queue_delay;
  batcher.max_queue_tokens = options.max_queue_tokens;
  batcher.hidden_size = model.layer.hidden_size;
  FrontEnd* self = fe.get();
  fe->batcher_ = std::make_unique<Batcher>(
      batcher, [self](int layer_pos, std::span<const worker::RowChunk> chunks) {
        return self->RunBatch(layer_pos, chunks);
      });

  ModelSignature signature;
  signature.name = options.model_name;
  signature.hidden_size = model.layer.hidden_size;
  signature.layers = model.moe_layers;
  // A request may be as large as the queue; the message limit bounds it too.
  signature.max_request_tokens = options.max_queue_tokens;
  fe->service_ = std::make_unique<InferenceService>(signature, model, *fe->batcher_, *fe->metrics_);

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.grpc_address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_request_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_request_bytes));
  builder.RegisterService(fe->service_.get());
  fe->server_ = builder.BuildAndStart();
  if (fe->server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve gRPC on --grpc-address=", options.grpc_address));
  }
  fe->grpc_address_ =
      absl::StrCat(options.grpc_address.substr(0, options.grpc_address.rfind(':')), ":", port);
  fe->metrics_->SetWorkersReady(shape.num_workers);
  fe->service_->set_ready(true);
  if (!options.ready_file.empty()) {
    absl::Status s = WriteReadyFile(options.ready_file, fe->grpc_address_, fe->metrics_address());
    if (!s.ok()) return s;
  }
  return fe;
}

FrontEnd::~FrontEnd() { Shutdown().IgnoreError(); }

absl::Status FrontEnd::RunBatch(int layer_pos, std::span<const worker::RowChunk> chunks) {
  int64_t rows = 0;
  for (const worker::RowChunk& c : chunks) rows += c.rows;
  metrics_->SetQueueTokens(batcher_->queued_tokens());
  absl::StatusOr<worker::BatchTrace> trace =
      coordinator_.Run(layer_pos, chunks, absl::Now() + options_.batch_timeout);
  if (!trace.ok()) {
    if (!coordinator_.healthy()) {
      service_->set_ready(false);
      metrics_->SetWorkersReady(0);
    }
    if (absl::IsCancelled(trace.status())) {
      return absl::UnavailableError("the server is shutting down; the batch was abandoned");
    }
    return trace.status();
  }
  metrics_->ObserveBatch(*trace, rows);
  return absl::OkStatus();
}

absl::Status FrontEnd::Shutdown() {
  if (shut_down_) return absl::OkStatus();
  shut_down_ = true;
  service_->set_ready(false);
  // Give a running batch drain_timeout to finish, then abandon it; Stop answers the rest.
  std::atomic<bool> stopped{false};
  std::thread watchdog([&] {
    const absl::Time give_up = absl::Now() + options_.drain_timeout;
    while (!stopped.load() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    if (!stopped.load()) coordinator_.Abort();
  });
  batcher_->Stop();
  stopped.store(true);
  watchdog.join();
  // Every reactor has finished; let gRPC flush the answers.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  return coordinator_.Stop(absl::Now() + absl::Seconds(2));
}

}  // namespace epserve::server
