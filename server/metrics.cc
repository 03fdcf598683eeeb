#include "server/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"

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

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Start(const std::string& address,
                                                        const std::string& model_name,
                                                        int num_workers, int num_experts) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->num_workers_ = num_workers;
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;

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
                    .Help("Token rows computed.")
                    .Register(r)
                    .Add({{"model", model_name}});
  auto& stages = prometheus::BuildHistogram()
                     .Name("epserve_stage_duration_seconds")
                     .Help("Duration of each stage of a batch, per rank.")
                     .Register(r);
  m->scatter_seconds_ = &stages.Add({{"stage", "scatter"}, {"rank", "0"}}, LatencyBuckets());
  m->gather_seconds_ = &stages.Add({{"stage", "gather"}, {"rank", "0"}}, LatencyBuckets());
  m->stage_seconds_.resize(num_workers);
  for (int w = 0; w < num_workers; ++w) {
    for (int s = 0; s < worker::kNumWorkerStages; ++s) {
      m->stage_seconds_[w][s] = &stages.Add(
          {{"stage", worker::WorkerStageName(s)}, {"rank", absl::StrCat(w + 1)}}, LatencyBuckets());
    }
  }
  auto& expert_tokens = prometheus::BuildCounter()
                            .Name("epserve_expert_tokens_total")
                            .Help("Token rows routed to each expert.")
                            .Register(r);
  for (int e = 0; e < num_experts; ++e) {
    m->expert_tokens_.push_back(&expert_tokens.Add({{"expert", absl::StrCat(e)}}));
  }
  m->queue_tokens_ = &prometheus::BuildGauge()
                          .Name("epserve_queue_tokens")
                          .Help("Token rows waiting in the batcher's queue.")
                          .Register(r)
                          .Add({});
  m->workers_ready_ = &prometheus::BuildGauge()
                           .Name("epserve_workers_ready")
                           .Help("Expert workers that have loaded their weights and answer.")
                           .Register(r)
                           .Add({});
  m->heap_bytes_ = &prometheus::BuildGauge()
                        .Name("epserve_heap_bytes")
                        .Help("Bytes of the symmetric heap per rank.")
                        .Register(r)
                        .Add({});
  prometheus::BuildGauge()
      .Name("epserve_build_info")
      .Help("Build information; always 1.")
      .Register(r)
      .Add({{"version", EPSERVE_VERSION}})
      .Set(1);

  try {  // configuration time: prometheus-cpp reports a failed bind by throwing
    m->exposer_ = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on --metrics-address=", address, ": ", e.what()));
  }
  m->exposer_->RegisterCollectable(m->registry_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  if (ports.empty()) return absl::InternalError("metrics exposer reports no listening port");
  m->bound_address_ = absl::StrCat(address.substr(0, address.rfind(':')), ":", ports.front());
  return m;
}

Metrics::~Metrics() = default;

void Metrics::ObserveRequest(absl::StatusCode code, absl::Duration latency,
                             absl::Duration queue_time, int64_t tokens) {
  const int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) return;
  requests_[c]->Increment();
  request_seconds_[c]->Observe(absl::ToDoubleSeconds(latency));
  if (code == absl::StatusCode::kOk) {
    queue_seconds_->Observe(absl::ToDoubleSeconds(queue_time));
    tokens_->Increment(static_cast<double>(tokens));
  }
}

void Metrics::ObserveBatch(const worker::BatchTrace& trace, int64_t rows) {
  batch_tokens_->Observe(static_cast<double>(rows));
  scatter_seconds_->Observe(trace.scatter_ns * 1e-9);
  gather_seconds_->Observe(trace.gather_ns * 1e-9);
  for (size_t w = 0; w < trace.stage_ns.size() && w < stage_seconds_.size(); ++w) {
    for (int s = 0; s < worker::kNumWorkerStages; ++s) {
      stage_seconds_[w][s]->Observe(trace.stage_ns[w][s] * 1e-9);
    }
  }
  for (size_t e = 0; e < trace.expert_tokens.size() && e < expert_tokens_.size(); ++e) {
    expert_tokens_[e]->Increment(static_cast<double>(trace.expert_tokens[e]));
  }
}

void Metrics::SetQueueTokens(int64_t tokens) { queue_tokens_->Set(static_cast<double>(tokens)); }
void Metrics::SetWorkersReady(int workers) { workers_ready_->Set(workers); }
void Metrics::SetHeapBytes(int64_t bytes) { heap_bytes_->Set(static_cast<double>(bytes)); }

}  // namespace epserve::server
