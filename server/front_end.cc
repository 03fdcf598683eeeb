#include "server/front_end.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"
#include "worker/eplb.h"

namespace epserve::server {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  absl::StatusOr<std::string> pem = common::ReadWholeFile(path);
  if (!pem.ok()) return absl::InvalidArgumentError(absl::StrCat("cannot read ", flag, "=", path));
  if (pem->empty()) return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, " is empty"));
  return pem;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const FrontEndOptions& o) {
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (o.tls_cert.empty()) {
    if (!o.tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadPem(o.tls_cert, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(o.tls_key, "--tls-key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(
      o.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!o.tls_client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(o.tls_client_ca, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(ssl);
}

// A message bound: `flag` when set, else the largest valid request of the model (T x H FP32
// values) plus 64 KiB for names, parameters and the routing outputs, within gRPC's int.
int64_t EffectiveMessageBytes(int64_t flag, const FrontEndOptions& o, int64_t hidden_size) {
  if (flag > 0) return flag;
  const int64_t derived =
      o.requests.max_request_tokens * std::max<int64_t>(hidden_size, 1) * 4 + (64 << 10);
  return std::min<int64_t>(derived, INT32_MAX);
}

// The memory budget: --max-inflight-bytes when set, else twice what the pipeline holds at
// its fullest, each row FP32 in and out: a full queue, three batches (one forming, one
// running, one answering) and a largest request arriving; at least 16 MiB.
int64_t EffectiveInflightBytes(const FrontEndOptions& o, int64_t hidden_size) {
  if (o.service.max_inflight_bytes > 0) return o.service.max_inflight_bytes;
  const int64_t rows =
      o.batching.max_queue_tokens + 3 * o.batching.max_batch_tokens + o.requests.max_request_tokens;
  return std::max<int64_t>(2 * rows * std::max<int64_t>(hidden_size, 1) * 8, int64_t{16} << 20);
}

// gRPC's own memory (its buffers, calls and connections): --grpc-memory-quota when set, else
// the service's budget plus room for 16 largest requests being received.
int64_t EffectiveGrpcQuota(const FrontEndOptions& o, int64_t hidden_size) {
  if (o.grpc_memory_quota > 0) return o.grpc_memory_quota;
  return EffectiveInflightBytes(o, hidden_size) +
         16 * EffectiveMessageBytes(o.max_request_bytes, o, hidden_size);
}

int Millis(absl::Duration d) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), INT32_MAX));
}

// Message sizes, connection lifetimes, keepalive policy, streams per connection, handshake
// timeout and gRPC's memory quota, from the options.
void ApplyConnectionLimits(grpc::ServerBuilder& builder, const FrontEndOptions& o,
                           const ServedModel& model) {
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(EffectiveMessageBytes(o.max_request_bytes, o, model.hidden_size)));
  builder.SetMaxSendMessageSize(
      static_cast<int>(EffectiveMessageBytes(o.max_response_bytes, o, model.hidden_size)));
  // A replacement job binds the same port while this one drains (deploy/supervisor.py).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, Millis(o.max_connection_idle));
  if (o.max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, Millis(o.max_connection_age));
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Millis(o.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, Millis(o.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             o.keepalive_permit_without_calls ? 1 : 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             Millis(o.http2_min_recv_ping_interval));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, o.http2_max_ping_strikes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, o.streams.max_streams);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             Millis(o.grpc_handshake_timeout));
  grpc::ResourceQuota quota("epserve-grpc");
  quota.Resize(static_cast<size_t>(EffectiveGrpcQuota(o, model.hidden_size)));
  builder.SetResourceQuota(quota);
}

}  // namespace

absl::Status FrontEndOptions::Validate() const {
  EPSERVE_RETURN_IF_ERROR(batching.Validate());
  EPSERVE_RETURN_IF_ERROR(requests.Validate());
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (batching.max_queue_tokens < requests.max_request_tokens) {
    return bad("--max-queue-tokens (", batching.max_queue_tokens,
               ") must be >= --max-request-tokens (", requests.max_request_tokens, ")");
  }
  for (int64_t bytes : {max_request_bytes, max_response_bytes}) {
    if (bytes != 0 && (bytes < 1024 || bytes > INT32_MAX)) {
      return bad(
          "--max-request-bytes and --max-response-bytes must be 0 (derived from the "
          "model) or in [1024, ",
          INT32_MAX, "]");
    }
  }
  if (max_connection_idle <= absl::ZeroDuration()) {
    return bad("--grpc-max-connection-idle must be > 0");
  }
  if (worker_stall_timeout <= absl::ZeroDuration()) {
    return bad("--worker-stall-timeout must be > 0");
  }
  if (max_connection_age < absl::ZeroDuration()) {
    return bad("--grpc-max-connection-age must be >= 0 (0: no limit)");
  }
  EPSERVE_RETURN_IF_ERROR(service.Validate());
  if (grpc_memory_quota != 0 && grpc_memory_quota < (int64_t{1} << 20)) {
    return bad("--grpc-memory-quota must be 0 (derived) or >= 1048576");
  }
  if (eplb.interval_batches < 0) return bad("--eplb-interval must be >= 0 (0: off)");
  if (!(eplb.min_gain >= 0 && eplb.min_gain <= 1)) return bad("--eplb-min-gain must be in [0, 1]");
  if (respond_threads < 0 || respond_threads > 64) {
    return bad("--respond-threads must be in [0, 64], got ", respond_threads);
  }
  if (batches_in_flight < 1 || batches_in_flight > 2) {
    return bad("--batches-in-flight must be 1 or 2, got ", batches_in_flight);
  }
  if (host_copy_threads < 0 || host_copy_threads > 256) {
    return bad("--host-copy-threads must be in [0, 256], got ", host_copy_threads);
  }
  if (eplb.min_copies < 1) return bad("--eplb-min-copies must be at least 1");
  if (grpc_handshake_timeout <= absl::ZeroDuration()) {
    return bad("--grpc-handshake-timeout must be > 0");
  }
  return streams.Validate();
}

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

absl::StatusOr<std::unique_ptr<FrontEnd>> FrontEnd::Start(
    const FrontEndOptions& options, const model::ModelConfig& model, const std::string& device,
    worker::Coordinator& coordinator, int64_t heap_bytes, ModelOpener open_model,
    uint64_t default_seed) {
  const worker::ExchangeShape& shape = coordinator.shape();
  ServedModel served{.hidden_size = model.layer.hidden_size,
                     .layers = model.moe_layers,
                     .num_workers = shape.num_workers,
                     .num_experts = shape.num_experts,
                     .top_k = shape.top_k,
                     .device = device};
  served.placements = coordinator.placements();
  served.workers_read_cuda = coordinator.workers_read_cuda();
  served.workers_read_shm = coordinator.workers_read_shm();
  std::unique_ptr<FrontEnd> fe(new FrontEnd(options, std::move(served), &coordinator));
  fe->model_ = model;
  fe->open_model_ = std::move(open_model);
  fe->default_seed_ = default_seed;
  fe->serving_seed_ = default_seed;
  FrontEnd* self = fe.get();
  Batcher::PipelinedExecutor pipelined;
  pipelined.start = [self](int layer_pos, std::span<const worker::RowChunk> c) {
    return self->StartBatch(layer_pos, c);
  };
  pipelined.finish = [self](uint64_t ticket, int layer_pos, std::span<const worker::RowChunk> c) {
    return self->FinishBatch(ticket, layer_pos, c);
  };
  pipelined.finished = [self](uint64_t ticket) {
    // Another thread's control step holds the coordinator: not finished as far as we know.
    std::unique_lock<std::mutex> exec(self->exec_mu_, std::try_to_lock);
    return exec.owns_lock() && self->coordinator_->Finished(ticket);
  };
  absl::Status s =
      options.batches_in_flight > 1
          ? fe->Init(nullptr, std::move(pipelined))
          : fe->Init([self](int layer_pos, std::span<const worker::RowChunk> c) -> absl::Status {
              EPSERVE_ASSIGN_OR_RETURN(const uint64_t ticket, self->StartBatch(layer_pos, c));
              return self->FinishBatch(ticket, layer_pos, c);
            });
  if (!s.ok()) return s;
  fe->metrics_->SetHeapBytes(heap_bytes);
  return fe;
}

absl::StatusOr<std::unique_ptr<FrontEnd>> FrontEnd::StartWithExecutor(
    const FrontEndOptions& options, const ServedModel& model, Batcher::Executor executor) {
  std::unique_ptr<FrontEnd> fe(new FrontEnd(options, model, nullptr));
  absl::Status s = fe->Init(std::move(executor));
  if (!s.ok()) return s;
  return fe;
}

void FrontEnd::StartStreamGuard() {
  StreamGuard::Callbacks guard_callbacks;
  guard_callbacks.on_close = [m = metrics_.get()](const std::string& peer, int64_t open,
                                                  const char* reason) {
    m->ObserveConnectionClosed(reason);
    common::LogWarning(
        absl::StrCat("closed gRPC connection ", peer, ": ",
                     std::string_view(reason) == "stream_limit"
                         ? absl::StrCat(open, " open streams, more than --max-concurrent-streams")
                         : std::string("idle, and more connections than --grpc-max-connections")));
  };
  guard_callbacks.on_count = [m = metrics_.get()](int64_t n) { m->SetGrpcConnections(n); };
  guard_callbacks.held_calls = [s = service_.get()](const std::string& peer) {
    return s->CallsOf(peer);
  };
  stream_guard_ = std::make_unique<StreamGuard>(options_.streams, std::move(guard_callbacks));
}

absl::Status FrontEnd::Init(Batcher::Executor executor, Batcher::PipelinedExecutor pipelined) {
  const FrontEndOptions& o = options_;
  absl::StatusOr<std::shared_ptr<const Authenticator>> auth =
      Authenticator::FromFile(o.auth_token_file);
  if (!auth.ok()) return auth.status();
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = Credentials(o);
  if (!creds.ok()) return creds.status();

  EPSERVE_ASSIGN_OR_RETURN(metrics_, Metrics::Start(o.metrics, o.requests.model_name, served_,
                                                    o.batching.max_queue_tokens));
  StartBatcher(std::move(executor), std::move(pipelined));
  service_ = std::make_unique<InferenceService>(o.service, served_, o.requests,
                                                EffectiveInflightBytes(o, served_.hidden_size),
                                                *batcher_, metrics_.get(), statistics_, *auth);
  if (coordinator_ != nullptr && open_model_) {
    service_->set_weight_loader([this](const std::string& m, std::optional<uint64_t> seed) {
      return SwapWeights(m, seed);
    });
  }
  health_ = std::make_unique<HealthService>();
  EPSERVE_RETURN_IF_ERROR(StartGrpc(*creds, **auth));
  StartStreamGuard();
  metrics_->SetWorkersReady(served_.num_workers);
  SetReady(true);
  if (coordinator_ != nullptr) {
    watcher_ = std::thread([this, w = served_.num_workers] {
      common::NameThisThread("ep-heartbeats");
      WatchHeartbeats(w);
    });
    if (o.eplb.interval_batches > 0 && open_model_) {
      eplb_load_.assign(served_.layers.size(), std::vector<double>(served_.num_experts, 0.0));
      rebalancer_ = std::thread([this] {
        common::NameThisThread("ep-rebalance");
        RebalanceLoop();
      });
    }
  }
  if (!o.ready_file.empty()) {
    absl::Status s = WriteReadyFile(o.ready_file, grpc_address_, metrics_address());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void FrontEnd::StartBatcher(Batcher::Executor executor, Batcher::PipelinedExecutor pipelined) {
  const FrontEndOptions& o = options_;
  // Rank 0's per-row work (row copies into and out of the heap, dtype conversions) on
  // threads where the host has cores to spare.
  const int copy_threads =
      o.host_copy_threads > 0 ? o.host_copy_threads : common::DefaultCopyThreads();
  BatchingOptions batching = o.batching;
  batching.copy_threads = copy_threads;
  batching.end_poll =
      common::ThreadsToSpare(o.ranks_on_host) ? absl::Microseconds(5) : absl::Microseconds(50);
  // As many threads hand answers to gRPC (its serialisation of large answers), so that the
  // completion thread goes on with the next batch.
  batching.respond_threads = o.respond_threads > 0 ? o.respond_threads : copy_threads;
  if (coordinator_ != nullptr) coordinator_->set_copy_threads(copy_threads);
  // The coordinator converts BF16 and FP16 rows as it copies them into and out of the heap.
  batching.executor_converts = coordinator_ != nullptr;
  common::LogInfo(absl::StrCat(
      "rank 0: ", copy_threads, " thread(s) for row copies and conversions (",
      o.host_copy_threads > 0 ? "--host-copy-threads" : "a quarter of the host's hardware threads",
      "), ", batching.respond_threads > 1 ? batching.respond_threads : 0,
      " answering (0: the completion thread answers); ", o.batches_in_flight,
      " batch(es) in flight; requests of up to ", batching.direct_batch_tokens,
      " tokens start on their gRPC thread when the pipeline is idle (--direct-batch-tokens); "
      "a running batch's end looked at every ",
      absl::FormatDuration(batching.end_poll), " or 1/64 of its time"));
  Batcher::BatchObserver observer = [this](int64_t rows, absl::Duration in, absl::Duration infer,
                                           absl::Duration out, absl::Duration respond) {
    statistics_.ObserveBatch(rows, in, infer, out);
    metrics_->ObserveRespond(respond);
    metrics_->SetQueueTokens(batcher_->queued_tokens());
  };
  Batcher::SkipObserver skipped = [m = metrics_.get()](absl::StatusCode code, int64_t rows) {
    m->ObserveSkippedRows(code, rows);
  };
  batcher_ =
      pipelined.start
          ? std::make_unique<Batcher>(batching, served_, o.requests.priority_levels,
                                      std::move(pipelined), std::move(observer), std::move(skipped))
          : std::make_unique<Batcher>(batching, served_, o.requests.priority_levels,
                                      std::move(executor), std::move(observer), std::move(skipped));
}

absl::Status FrontEnd::StartGrpc(const std::shared_ptr<grpc::ServerCredentials>& creds,
                                 const Authenticator& auth) {
  const FrontEndOptions& o = options_;
  if (o.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.grpc_address, creds, &port);
  ApplyConnectionLimits(builder, o, served_);
  if (auth.enabled()) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(auth.InterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  builder.RegisterService(service_.get());
  builder.RegisterService(health_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve gRPC on --grpc-address=", o.grpc_address));
  }
  grpc_address_ = absl::StrCat(o.grpc_address.substr(0, o.grpc_address.rfind(':')), ":", port);
  return absl::OkStatus();
}

FrontEnd::~FrontEnd() {
  if (server_ != nullptr) Shutdown().IgnoreError();
}

void FrontEnd::SetReady(bool ready) {
  service_->set_ready(ready);
  health_->SetServing(ready);
}

void FrontEnd::NotReadyIfExchangeFailed() {
  if (coordinator_->healthy()) return;
  SetReady(false);
  metrics_->SetWorkersReady(0);
}

absl::StatusOr<uint64_t> FrontEnd::StartBatch(int layer_pos,
                                              std::span<const worker::RowChunk> chunks) {
  metrics_->SetQueueTokens(batcher_->queued_tokens());
  absl::StatusOr<uint64_t> ticket;
  {
    std::lock_guard<std::mutex> exec(exec_mu_);
    ticket = coordinator_->Start(layer_pos, chunks, absl::Now() + options_.batch_timeout);
  }
  if (!ticket.ok()) NotReadyIfExchangeFailed();
  return ticket;
}

absl::Status FrontEnd::FinishBatch(uint64_t ticket, int layer_pos,
                                   std::span<const worker::RowChunk> chunks) {
  int64_t rows = 0;
  for (const worker::RowChunk& c : chunks) rows += c.rows;
  std::unique_lock<std::mutex> exec(exec_mu_);
  absl::StatusOr<worker::BatchTrace> trace = coordinator_->Finish(ticket);
  if (const int lost = coordinator_->lost_workers();
      lost != lost_seen_ && coordinator_->healthy()) {
    // A worker died and the service goes on with the survivors: their placements now (the
    // heartbeat watch sets epserve_workers_lost and _ready).
    lost_seen_ = lost;
    metrics_->SetReplicas(coordinator_->placements());
  }
  exec.unlock();
  if (!trace.ok()) {
    NotReadyIfExchangeFailed();
    if (absl::IsCancelled(trace.status())) {
      return absl::UnavailableError("the server is shutting down; the batch was abandoned");
    }
    return trace.status();
  }
  metrics_->ObserveBatch(*trace, rows, layer_pos);
  if (options_.eplb.interval_batches > 0) {
    std::lock_guard<std::mutex> lock(eplb_mu_);
    if (layer_pos >= 0 && layer_pos < static_cast<int>(eplb_load_.size())) {
      std::vector<double>& load = eplb_load_[layer_pos];
      for (size_t e = 0; e < load.size() && e < trace->expert_tokens.size(); ++e) {
        load[e] += static_cast<double>(trace->expert_tokens[e]);
      }
      ++eplb_batches_;
    }
  }
  return absl::OkStatus();
}

void FrontEnd::WatchHeartbeats(int num_workers) {
  bool stalled = false;
  int lost = 0;  // workers whose process died (Coordinator's watch)
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (
      !watch_cv_.wait_for(lock, std::chrono::milliseconds(250), [this] { return watch_stop_; })) {
    const int n = coordinator_->StalledWorkers(options_.worker_stall_timeout);
    if (n < 0) return;  // no heartbeats on this heap backend
    if (const int now_lost = coordinator_->lost_workers(); now_lost != lost) {
      // Dead workers are not stalled ones: readiness stays while the survivors serve.
      lost = now_lost;
      metrics_->SetWorkersLost(lost);
      if (coordinator_->healthy()) metrics_->SetWorkersReady(num_workers - lost - n);
    }
    if (n > 0 && !stalled) {
      stalled = true;
      SetReady(false);
      metrics_->SetWorkersReady(num_workers - lost - n);
      common::LogWarning(absl::StrCat(n, " worker(s) sent no heartbeat for ",
                                      absl::FormatDuration(options_.worker_stall_timeout),
                                      ": not ready until they do"));
    } else if (n == 0 && stalled) {
      stalled = false;
      if (coordinator_->healthy()) {
        SetReady(true);
        metrics_->SetWorkersReady(num_workers - lost);
        common::LogInfo("every live worker beats again: ready");
      }
    }
  }
}

absl::Status FrontEnd::Shutdown() {
  if (shut_down_) return absl::OkStatus();
  shut_down_ = true;
  stopping_.store(true);
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  if (rebalancer_.joinable()) rebalancer_.join();
  stream_guard_.reset();
  SetReady(false);      // new requests get UNAVAILABLE; health says NOT_SERVING
  health_->Shutdown();  // ends health Watch streams
  // gRPC's shutdown starts at once: calls not yet accepted are refused with UNAVAILABLE, and
  // every accepted one, handler not run yet included, is waited for while the batcher
  // answers it. Past the deadline gRPC cancels what is still open (streams a client keeps).
  std::thread grpc_shutdown([this] {
    server_->Shutdown(
        absl::ToChronoTime(absl::Now() + options_.drain_timeout + absl::Milliseconds(200)));
  });
  // Give formed batches drain_timeout to finish, then abandon them; Stop answers the rest.
  std::atomic<bool> stopped{false};
  std::thread watchdog([&] {
    const absl::Time give_up = absl::Now() + options_.drain_timeout;
    while (!stopped.load() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
    if (!stopped.load() && coordinator_ != nullptr) coordinator_->Abort();
  });
  batcher_->Stop();
  stopped.store(true);
  watchdog.join();
  // Every accepted request has its answer: the workers stop while gRPC flushes. A weight
  // swap's step waiting on the workers gives up at once (Abort), and no later one starts.
  absl::Status s;
  if (coordinator_ != nullptr) {
    coordinator_->Abort();
    std::lock_guard<std::mutex> exec(exec_mu_);
    s = coordinator_->Stop(absl::Now() + absl::Seconds(2));
  }
  grpc_shutdown.join();
  return s;
}

}  // namespace epserve::server
