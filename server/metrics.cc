#include "server/metrics.h"

#include <netdb.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string_view>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "model/load_profile.h"
#include "worker/placement.h"

namespace epserve::server {
namespace {

// Latencies this system sees: tens of microseconds (a stage of a small batch) to seconds.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
          25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0};
}

std::string CodeName(absl::StatusCode code) {
  // gRPC's names: OK, CANCELLED, INVALID_ARGUMENT, ...
  std::string name = absl::StatusCodeToString(code);
  for (char& c : name) c = c == ' ' ? '_' : static_cast<char>(std::toupper(c));
  return name;
}

}  // namespace

// Requests: answers by code, their latency, queueing, batch sizes, tokens.
void Metrics::RegisterRequestMetrics(const std::string& model_name) {
  Metrics* m = this;
  prometheus::Registry& r = *registry_;
  auto& requests = prometheus::BuildCounter()
                       .Name("epserve_requests_total")
                       .Help("Inference requests answered, by gRPC status code.")
                       .Register(r);
  auto& request_seconds = prometheus::BuildHistogram()
                              .Name("epserve_request_duration_seconds")
                              .Help("Time from accepting an inference request to answering it.")
                              .Register(r);
  for (int c = 0; c < kNumCodes; ++c) {
    const std::string code = CodeName(static_cast<absl::StatusCode>(c));
    m->requests_[c] = &requests.Add({{"model", model_name}, {"code", code}});
    m->request_seconds_[c] =
        &request_seconds.Add({{"model", model_name}, {"code", code}}, LatencyBuckets());
  }
  m->queue_seconds_ = &prometheus::BuildHistogram()
                           .Name("epserve_queue_duration_seconds")
                           .Help("Time a request waited in the batcher's queue.")
                           .Register(r)
                           .Add({{"model", model_name}}, LatencyBuckets());
  m->batch_tokens_ =
      &prometheus::BuildHistogram()
           .Name("epserve_batch_tokens")
           .Help("Token rows per batch.")
           .Register(r)
           .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256, 512,
                                                            1024, 2048, 4096, 8192});
  m->tokens_ = &prometheus::BuildCounter()
                    .Name("epserve_tokens_total")
                    .Help("Token rows answered successfully.")
                    .Register(r)
                    .Add({{"model", model_name}});
}

// Rebalances while serving (--eplb-interval): outcomes, the last one's time, bytes loaded.
void Metrics::RegisterRebalanceMetrics() {
  prometheus::Registry& r = *registry_;
  auto& rebalances = prometheus::BuildCounter()
                         .Name("epserve_eplb_rebalances_total")
                         .Help(
                             "Expert rebalances while serving (--eplb-interval), by outcome: "
                             "done, skipped (the expected gain was below --eplb-min-gain), "
                             "failed.")
                         .Register(r);
  for (const char* outcome : {"done", "skipped", "failed"}) {
    rebalances_[outcome] = &rebalances.Add({{"outcome", outcome}});
  }
  rebalance_seconds_ = &prometheus::BuildGauge()
                            .Name("epserve_eplb_rebalance_seconds")
                            .Help("How long the last rebalance took, loading to switch.")
                            .Register(r)
                            .Add({});
  rebalance_bytes_ = &prometheus::BuildCounter()
                          .Name("epserve_eplb_loaded_bytes_total")
                          .Help(
                              "Weight bytes the workers read from the source for rebalances "
                              "(experts a worker already held are copied on its device).")
                          .Register(r)
                          .Add({});
}

// A batch's stage latencies per rank.
void Metrics::RegisterStageMetrics(const ServedModel& model) {
  Metrics* m = this;
  auto& stages = prometheus::BuildHistogram()
                     .Name("epserve_stage_duration_seconds")
                     .Help("Duration of each stage of a batch, per rank (0: front-end).")
                     .Register(*registry_);
  m->scatter_seconds_ = &stages.Add({{"stage", "scatter"}, {"rank", "0"}}, LatencyBuckets());
  m->gather_seconds_ = &stages.Add({{"stage", "gather"}, {"rank", "0"}}, LatencyBuckets());
  m->respond_seconds_ = &stages.Add({{"stage", "respond"}, {"rank", "0"}}, LatencyBuckets());
  m->stage_seconds_.resize(model.num_workers);
  for (int w = 0; w < model.num_workers; ++w) {
    for (int s = 0; s < worker::kNumWorkerStages; ++s) {
      m->stage_seconds_[w][s] = &stages.Add(
          {{"stage", worker::WorkerStageName(s)}, {"rank", absl::StrCat(worker::RankOfWorker(w))}},
          LatencyBuckets());
    }
  }
}

// Batches: stage latencies per rank, bytes exchanged, rows the workers took, per-expert load
// and balance (and, in the order /metrics lists them, the rebalances').
void Metrics::RegisterBatchMetrics(const ServedModel& model) {
  Metrics* m = this;
  prometheus::Registry& r = *registry_;
  RegisterStageMetrics(model);
  auto& exchange = prometheus::BuildCounter()
                       .Name("epserve_exchange_bytes_total")
                       .Help("Bytes moved between workers through the heap, by direction.")
                       .Register(r);
  m->exchange_bytes_[0] = &exchange.Add({{"direction", "dispatch"}});
  m->exchange_bytes_[1] = &exchange.Add({{"direction", "combine"}});
  m->client_rows_ = &prometheus::BuildCounter()
                         .Name("epserve_rows_read_by_workers_total")
                         .Help(
                             "Token rows the workers read from clients' memory themselves "
                             "(CUDA or system shared memory), which rank 0 did not copy.")
                         .Register(r)
                         .Add({});
  auto& expert_tokens = prometheus::BuildCounter()
                            .Name("epserve_expert_tokens_total")
                            .Help("Token rows routed to each expert, by layer.")
                            .Register(r);
  auto& balancedness =
      prometheus::BuildGauge()
          .Name("epserve_expert_balancedness")
          .Help(absl::StrCat("Mean over max tokens per expert over the last ",
                             kBalanceWindowBatches, " batches of the layer (1: even)."))
          .Register(r);
  auto& worker_pairs = prometheus::BuildCounter()
                           .Name("epserve_worker_pairs_total")
                           .Help("(token, expert) pairs each worker computed, by layer.")
                           .Register(r);
  auto& worker_balancedness =
      prometheus::BuildGauge()
          .Name("epserve_worker_balancedness")
          .Help(absl::StrCat("Mean over max pairs per worker over the last ", kBalanceWindowBatches,
                             " batches of the layer (1: even; what --redundant-experts evens)."))
          .Register(r);
  auto& replicas = prometheus::BuildGauge()
                       .Name("epserve_expert_replicas")
                       .Help("Copies of each expert the workers hold, by layer.")
                       .Register(r);
  RegisterRebalanceMetrics();
  m->layer_ids_ = model.layers;
  m->num_experts_ = model.num_experts;
  for (size_t pos = 0; pos < model.layers.size(); ++pos) {
    LayerSeries l;
    const std::string layer_label = absl::StrCat(model.layers[pos]);
    for (int e = 0; e < model.num_experts; ++e) {
      l.expert_tokens.push_back(
          &expert_tokens.Add({{"layer", layer_label}, {"expert", absl::StrCat(e)}}));
      l.replicas.push_back(&replicas.Add({{"layer", layer_label}, {"expert", absl::StrCat(e)}}));
      l.replicas.back()->Set(1);
    }
    for (int w = 0; w < model.num_workers; ++w) {
      l.worker_pairs.push_back(
          &worker_pairs.Add({{"layer", layer_label}, {"worker", absl::StrCat(w)}}));
    }
    l.balancedness = &balancedness.Add({{"layer", layer_label}});
    l.balancedness->Set(1.0);
    l.worker_balancedness = &worker_balancedness.Add({{"layer", layer_label}});
    l.worker_balancedness->Set(1.0);
    l.experts = BalanceWindow(model.num_experts);
    l.workers = BalanceWindow(model.num_workers);
    m->layers_.push_back(std::move(l));
  }
  m->SetReplicas(model.placements);
}

// The server's state: in flight, queued, workers ready, memory.
void Metrics::RegisterStateMetrics(const ServedModel& model, int64_t queue_capacity_tokens) {
  Metrics* m = this;
  prometheus::Registry& r = *registry_;
  m->inflight_ = &prometheus::BuildGauge()
                      .Name("epserve_inflight_requests")
                      .Help("Inference requests received and not yet answered.")
                      .Register(r)
                      .Add({});
  m->queue_tokens_ = &prometheus::BuildGauge()
                          .Name("epserve_queue_tokens")
                          .Help("Token rows waiting in the batcher's queue.")
                          .Register(r)
                          .Add({});
  prometheus::BuildGauge()
      .Name("epserve_queue_capacity_tokens")
      .Help("Most token rows the queue holds (--max-queue-tokens).")
      .Register(r)
      .Add({})
      .Set(static_cast<double>(queue_capacity_tokens));
  m->workers_ready_ = &prometheus::BuildGauge()
                           .Name("epserve_workers_ready")
                           .Help("Expert workers that have loaded their weights and answer.")
                           .Register(r)
                           .Add({});
  m->workers_lost_ = &prometheus::BuildGauge()
                          .Name("epserve_workers_lost")
                          .Help(
                              "Expert workers of this job whose process died; the job serves "
                              "on the survivors where every expert kept a copy.")
                          .Register(r)
                          .Add({});
  prometheus::BuildGauge()
      .Name("epserve_workers_configured")
      .Help("Expert workers the cluster was launched with.")
      .Register(r)
      .Add({})
      .Set(model.num_workers);
  m->heap_bytes_ = &prometheus::BuildGauge()
                        .Name("epserve_heap_bytes")
                        .Help("Bytes of the symmetric heap per rank.")
                        .Register(r)
                        .Add({});
  m->held_bytes_ = &prometheus::BuildGauge()
                        .Name("epserve_held_bytes")
                        .Help(
                            "Bytes of requests and answers rank 0 holds for calls (queued, "
                            "computing, or answered and not yet sent).")
                        .Register(r)
                        .Add({});
  m->held_bytes_limit_ = &prometheus::BuildGauge()
                              .Name("epserve_held_bytes_limit")
                              .Help("The bound of epserve_held_bytes (--max-inflight-bytes).")
                              .Register(r)
                              .Add({});
}

// What the server did against clients and for operators: calls and connections closed, rows
// skipped, weight swaps, build.
void Metrics::RegisterProtectionMetrics() {
  Metrics* m = this;
  prometheus::Registry& r = *registry_;
  auto& closed = prometheus::BuildCounter()
                     .Name("epserve_grpc_calls_closed_total")
                     .Help(
                         "Calls the server closed because the client did not take an "
                         "answer: within --answer-timeout (answer_timeout), or while the "
                         "memory budget was short (memory_pressure).")
                     .Register(r);
  m->closed_answer_timeout_ = &closed.Add({{"reason", "answer_timeout"}});
  m->closed_memory_pressure_ = &closed.Add({{"reason", "memory_pressure"}});
  auto& closed_connections =
      prometheus::BuildCounter()
          .Name("epserve_grpc_connections_closed_total")
          .Help(
              "gRPC connections the server shut down: stream_limit, more open streams than "
              "--max-concurrent-streams (a client that never acknowledged SETTINGS); "
              "connection_limit, idle beyond --grpc-max-connections.")
          .Register(r);
  m->closed_stream_limit_ = &closed_connections.Add({{"reason", "stream_limit"}});
  m->closed_connection_limit_ = &closed_connections.Add({{"reason", "connection_limit"}});
  m->grpc_connections_ = &prometheus::BuildGauge()
                              .Name("epserve_grpc_open_connections")
                              .Help(
                                  "gRPC connections open past the HTTP/2 handshake (from "
                                  "channelz, about once a second).")
                              .Register(r)
                              .Add({});
  auto& skipped = prometheus::BuildCounter()
                      .Name("epserve_rows_skipped_total")
                      .Help(
                          "Token rows taken out of a batch before they were computed, by "
                          "why: cancelled by the client, deadline passed, request failed.")
                      .Register(r);
  m->skipped_rows_[0] = &skipped.Add({{"reason", "cancelled"}});
  m->skipped_rows_[1] = &skipped.Add({{"reason", "deadline"}});
  m->skipped_rows_[2] = &skipped.Add({{"reason", "failed"}});
  auto& swaps = prometheus::BuildCounter()
                    .Name("epserve_weight_swaps_total")
                    .Help(
                        "RepositoryModelLoad calls that replaced the served weights (ok) or "
                        "left the old ones serving (failed).")
                    .Register(r);
  m->swaps_ok_ = &swaps.Add({{"result", "ok"}});
  m->swaps_failed_ = &swaps.Add({{"result", "failed"}});
  m->swap_seconds_ = &prometheus::BuildGauge()
                          .Name("epserve_weight_swap_seconds")
                          .Help("How long the last weight swap took, checks and loading included.")
                          .Register(r)
                          .Add({});
  prometheus::BuildGauge()
      .Name("epserve_build_info")
      .Help("Build information; always 1.")
      .Register(r)
      .Add({{"version", EPSERVE_VERSION}})
      .Set(1);
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(const MetricsHttpOptions& http,
                                                        const std::string& model_name,
                                                        const ServedModel& model,
                                                        int64_t queue_capacity_tokens) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->num_workers_ = model.num_workers;
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;

  m->RegisterRequestMetrics(model_name);
  m->RegisterBatchMetrics(model);
  m->RegisterStateMetrics(model, queue_capacity_tokens);
  m->RegisterProtectionMetrics();
  auto& http_events = prometheus::BuildCounter()
                          .Name("epserve_metrics_http_connections_total")
                          .Help(
                              "Connections to the /metrics endpoint by what became of them: "
                              "accepted, served (a scrape answered), bad_request, "
                              "header_timeout, idle_timeout, write_timeout, evicted (closed "
                              "at the connection or pending-bytes bound).")
                          .Register(r);
  for (int e = 0; e < kNumHttpEvents; ++e) {
    m->http_events_[e] = &http_events.Add({{"event", HttpEventName(static_cast<HttpEvent>(e))}});
  }
  m->http_open_ = &prometheus::BuildGauge()
                       .Name("epserve_metrics_http_open_connections")
                       .Help("Connections open to the /metrics endpoint.")
                       .Register(r)
                       .Add({});

  Metrics* self = m.get();
  EPSERVE_ASSIGN_OR_RETURN(
      m->http_,
      MetricsHttpServer::Start(
          http,
          [self] {
            self->http_open_->Set(self->http_ != nullptr ? self->http_->open_connections() : 0);
            return prometheus::TextSerializer().Serialize(self->registry_->Collect());
          },
          [self](HttpEvent e) { self->http_events_[static_cast<int>(e)]->Increment(); },
          {{.path = "/eplb/profile", .content_type = "application/json", .render = [self] {
              return self->ExpertLoadProfile();
            }}}));
  m->bound_address_ = m->http_->bound_address();
  return m;
}

Metrics::~Metrics() { http_.reset(); }

std::string Metrics::ExpertLoadProfile() const {
  model::ExpertLoadProfile p;
  p.num_experts = num_experts_;
  for (size_t pos = 0; pos < layers_.size() && pos < layer_ids_.size(); ++pos) {
    std::vector<double>& loads = p.layers[layer_ids_[pos]];
    for (const prometheus::Counter* c : layers_[pos].expert_tokens) loads.push_back(c->Value());
  }
  return model::ExpertLoadProfileJson(p);
}

void Metrics::ObserveRebalance(const char* outcome, absl::Duration took, int64_t bytes,
                               const std::vector<worker::ExpertPlacement>* placements) {
  auto it = rebalances_.find(outcome);
  if (it != rebalances_.end()) it->second->Increment();
  if (std::string_view(outcome) != "done") return;
  rebalance_seconds_->Set(absl::ToDoubleSeconds(took));
  rebalance_bytes_->Increment(static_cast<double>(bytes));
  if (placements != nullptr) SetReplicas(*placements);
}

void Metrics::SetReplicas(const std::vector<worker::ExpertPlacement>& placements) {
  for (size_t pos = 0; pos < placements.size() && pos < layers_.size(); ++pos) {
    const worker::ExpertPlacement& p = placements[pos];
    for (int e = 0; e < p.num_experts() && e < static_cast<int>(layers_[pos].replicas.size());
         ++e) {
      layers_[pos].replicas[e]->Set(static_cast<double>(p.copies(e).size()));
    }
  }
}

std::optional<double> Metrics::BalanceWindow::Add(std::span<const int64_t> counts,
                                                  const std::vector<bool>& counted) {
  std::vector<int64_t>& slot = ring_[next_];
  next_ = (next_ + 1) % ring_.size();
  int64_t total = 0, most = 0, entries = 0;
  for (size_t i = 0; i < sum_.size(); ++i) {
    const int64_t now = i < counts.size() ? counts[i] : 0;
    sum_[i] += now - slot[i];
    slot[i] = now;
    if (!counted.empty() && (i >= counted.size() || !counted[i])) continue;
    ++entries;
    total += sum_[i];
    most = std::max(most, sum_[i]);
  }
  if (most == 0) return std::nullopt;
  return static_cast<double>(total) / static_cast<double>(entries) / static_cast<double>(most);
}

void Metrics::SetHeldBytes(int64_t bytes) { held_bytes_->Set(static_cast<double>(bytes)); }
void Metrics::SetHeldBytesLimit(int64_t bytes) {
  held_bytes_limit_->Set(static_cast<double>(bytes));
}

void Metrics::ObserveCallClosed(const char* reason) {
  (std::string_view(reason) == "answer_timeout" ? closed_answer_timeout_ : closed_memory_pressure_)
      ->Increment();
}

void Metrics::ObserveConnectionClosed(const char* reason) {
  (std::string_view(reason) == "stream_limit" ? closed_stream_limit_ : closed_connection_limit_)
      ->Increment();
}

void Metrics::ObserveWeightSwap(absl::StatusCode code, absl::Duration took) {
  (code == absl::StatusCode::kOk ? swaps_ok_ : swaps_failed_)->Increment();
  swap_seconds_->Set(absl::ToDoubleSeconds(took));
}

void Metrics::SetGrpcConnections(int64_t connections) {
  grpc_connections_->Set(static_cast<double>(connections));
}

void Metrics::ObserveSkippedRows(absl::StatusCode code, int64_t rows) {
  const int i = code == absl::StatusCode::kCancelled          ? 0
                : code == absl::StatusCode::kDeadlineExceeded ? 1
                                                              : 2;
  skipped_rows_[i]->Increment(static_cast<double>(rows));
}  // stops the server thread before the series go

void Metrics::ObserveRequest(absl::StatusCode code, absl::Duration latency,
                             absl::Duration queue_time, int64_t tokens) {
  inflight_->Decrement();
  const int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) return;
  requests_[c]->Increment();
  request_seconds_[c]->Observe(absl::ToDoubleSeconds(latency));
  if (code == absl::StatusCode::kOk) {
    queue_seconds_->Observe(absl::ToDoubleSeconds(queue_time));
    tokens_->Increment(static_cast<double>(tokens));
  }
}

void Metrics::RequestStarted() { inflight_->Increment(); }

void Metrics::ObserveBatch(const worker::BatchTrace& trace, int64_t rows, int layer_pos) {
  batch_tokens_->Observe(static_cast<double>(rows));
  exchange_bytes_[0]->Increment(static_cast<double>(trace.dispatch_bytes));
  exchange_bytes_[1]->Increment(static_cast<double>(trace.combine_bytes));
  client_rows_->Increment(static_cast<double>(trace.client_rows));
  scatter_seconds_->Observe(trace.scatter_ns * 1e-9);
  gather_seconds_->Observe(trace.gather_ns * 1e-9);
  // A trace that names no workers (tests, executors) counts them all.
  auto took_part = [&](size_t w) {
    return trace.workers.Count() == 0 || trace.workers.Has(static_cast<int>(w));
  };
  for (size_t w = 0; w < trace.stage_ns.size() && w < stage_seconds_.size(); ++w) {
    if (!took_part(w)) continue;  // a dead worker measured nothing
    for (int s = 0; s < worker::kNumWorkerStages; ++s) {
      stage_seconds_[w][s]->Observe(trace.stage_ns[w][s] * 1e-9);
    }
  }
  if (layer_pos < 0 || layer_pos >= static_cast<int>(layers_.size())) return;
  LayerSeries& l = layers_[layer_pos];
  const size_t experts = std::min(trace.expert_tokens.size(), l.expert_tokens.size());
  for (size_t e = 0; e < experts; ++e) {
    l.expert_tokens[e]->Increment(static_cast<double>(trace.expert_tokens[e]));
  }
  const size_t workers = std::min(trace.worker_pairs.size(), l.worker_pairs.size());
  for (size_t w = 0; w < workers; ++w) {
    l.worker_pairs[w]->Increment(static_cast<double>(trace.worker_pairs[w]));
  }
  std::vector<bool> live(workers);  // a dead worker's idleness is not imbalance
  for (size_t w = 0; w < workers; ++w) live[w] = took_part(w);
  std::lock_guard<std::mutex> lock(balance_mu_);
  if (std::optional<double> b = l.workers.Add(std::span(trace.worker_pairs).first(workers), live)) {
    l.worker_balancedness->Set(*b);
  }
  if (std::optional<double> b = l.experts.Add(std::span(trace.expert_tokens).first(experts))) {
    l.balancedness->Set(*b);
  }
}

void Metrics::ObserveRespond(absl::Duration duration) {
  respond_seconds_->Observe(absl::ToDoubleSeconds(duration));
}

void Metrics::SetQueueTokens(int64_t tokens) { queue_tokens_->Set(static_cast<double>(tokens)); }
void Metrics::SetWorkersReady(int workers) { workers_ready_->Set(workers); }
void Metrics::SetWorkersLost(int workers) { workers_lost_->Set(workers); }
void Metrics::SetHeapBytes(int64_t bytes) { heap_bytes_->Set(static_cast<double>(bytes)); }

}  // namespace epserve::server
