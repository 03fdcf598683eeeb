// inference.GRPCInferenceService (KServe v2, Triton's field numbers) over the dynamic
// batcher, with system shared memory (server/shared_memory.h). The repository, CUDA
// shared-memory, trace and log RPCs answer UNIMPLEMENTED.
// Thread-safe: gRPC calls the handlers from its own threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "grpc_service.grpc.pb.h"
#include "server/auth.h"
#include "server/batcher.h"
#include "server/cuda_shared_memory.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/shared_memory.h"
#include "server/statistics.h"
#include "server/validation.h"

namespace epserve::server {

// The service's own settings, each bound to its flag. FrontEndOptions::service is their home.
struct ServiceOptions {
  // --max-stream-inflight: requests of one ModelStreamInfer stream read but not yet answered;
  // at the bound the server stops reading that stream until an answer is written.
  int max_stream_inflight = 64;
  // --max-inflight-bytes: bytes of requests and answers held for all calls together
  // (MemoryBudget); beyond it new requests get RESOURCE_EXHAUSTED. 0: derived from the model
  // and the batching and request bounds (the front-end's EffectiveInflightBytes), which the
  // service is given as its budget.
  int64_t max_inflight_bytes = 0;
  // --answer-timeout: an answer the client has not taken within this closes its call
  // (CANCELLED), freeing what the call holds. While the budget is short, calls whose answer
  // has waited min(1 s, answer_timeout) are closed first, the longest-waiting first.
  absl::Duration answer_timeout = absl::Seconds(30);
  // --keep-request-buffers: rank 0's allocator keeps freed request and answer buffers (up to
  // 32 MiB each; ConfigureAllocator sets glibc's thresholds) for the next requests, and the
  // reaper gives free memory back only once no request arrived for a second or it exceeds
  // twice what the calls hold (at least 128 MiB). Off: buffers of 4 MiB and more are
  // mmapped and go back when freed, and the reaper gives back whatever is free once a
  // second (32 MiB or more), which bounds rank 0's memory after a burst tightly but makes
  // every large request fault its pages in afresh.
  bool keep_request_buffers = false;

  // INVALID_ARGUMENT naming the flag and its bound.
  absl::Status Validate() const;
};

// glibc's allocator as the service wants it. Every epserve rank calls it first (app/main.cc), with
// keep_request_buffers on rank 0 under --keep-request-buffers; bench_frontend as rank 0 does. By
// default buffers under 4 MiB (a request or an answer of fewer than 512 tokens of hidden 2048 in
// FP32, gRPC's slices of them) come from the arenas, and an arena keeps up to 4 MiB free at its top
// instead of giving it back at each free, so that the next decode-sized request reuses those pages
// instead of faulting fresh ones in (glibc's fixed default keeps 128 KiB); larger buffers are
// mmapped and go back when freed, and the reaper (InferenceService) gives back free memory once it
// reaches 32 MiB. Not more than 4 MiB: malloc_trim gives back a thread arena's free chunks but not
// its top, so this is what each arena may keep after a burst (docs/ARCHITECTURE.md, "Rank 0's
// memory"). With keep_request_buffers: buffers up to 32 MiB from the arenas, kept up to 1 GiB (the
// reaper's rule for it: ServiceOptions::keep_request_buffers).
void ConfigureAllocator(bool keep_request_buffers);

class InferenceService final : public inference::GRPCInferenceService::CallbackService {
 public:
  // `options`, `model`, `requests`, `batcher`, `metrics` and `statistics` outlive the service;
  // `metrics` may be null. `budget_bytes` (> 0) bounds the bytes held for calls:
  // options.max_inflight_bytes, or the value derived when it is 0. The ModelConfig reports the
  // batcher's options.
  InferenceService(const ServiceOptions& options, const ServedModel& model,
                   const RequestOptions& requests, int64_t budget_bytes, Batcher& batcher,
                   Metrics* metrics, Statistics& statistics,
                   std::shared_ptr<const Authenticator> auth);
  ~InferenceService() override;  // stops the reaper; the gRPC server must be shut down first

  // Replaces the served weights (FrontEnd::SwapWeights): the model as --model names it, and
  // the seed (unset: the server's own). Blocks until done.
  using WeightLoader =
      std::function<absl::Status(const std::string& model, std::optional<uint64_t> seed)>;
  // Set before serving starts; without one, a load with parameters answers UNIMPLEMENTED.
  void set_weight_loader(WeightLoader loader) { weight_loader_ = std::move(loader); }

  // Ready: workers loaded and answering, not shutting down. Live: the process answers.
  void set_ready(bool ready) { ready_.store(ready); }
  bool ready() const { return ready_.load(); }

  // Validates `request`, charges its bytes and its answer's to the memory budget
  // (*charged), pre-sizes `response` and queues the request. On OK, `done` is called exactly
  // once (from a batcher thread) when the response is complete or failed; `request` and
  // `response` must live until then, and the caller releases *charged (ReleaseHeld) once the
  // answer is sent or dropped. On error nothing is charged and `done` is not called.
  absl::Status Submit(const inference::ModelInferRequest& request,
                      inference::ModelInferResponse* response, absl::Time start,
                      absl::Time deadline, std::function<bool()> cancelled,
                      std::function<void(absl::Status)> done, int64_t* charged);
  void ReleaseHeld(int64_t bytes);
  int64_t held_bytes() const { return budget_.used(); }
  // Inference calls the service holds (from their start to gRPC's OnDone) for the connection
  // to `peer`, as grpc::ServerContext::peer() names it.
  int64_t CallsOf(const std::string& peer);

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
  // Triton's system shared-memory extension (server/shared_memory.h).
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* req,
      inference::SystemSharedMemoryStatusResponse* resp) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryRegisterRequest* req,
      inference::SystemSharedMemoryRegisterResponse* resp) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* req,
      inference::SystemSharedMemoryUnregisterResponse* resp) override;

#define EPSERVE_UNIMPLEMENTED_RPC(Name)                                      \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* ctx,           \
                                 const inference::Name##Request* req,        \
                                 inference::Name##Response* resp) override { \
    return Unimplemented(ctx, #Name);                                        \
  }
  // The model repository extension over the one served model: the index, unload (out of
  // service: ModelReady false, inference NOT_FOUND; the weights stay on the workers) and load
  // (back into service; with the parameter `model` (and `seed`), or `config` holding
  // {"model": ..., "seed": ...}, new weights of the same shape replace the served ones
  // between requests, through the weight loader).
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* ctx,
                                            const inference::RepositoryIndexRequest* req,
                                            inference::RepositoryIndexResponse* resp) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* ctx, const inference::RepositoryModelLoadRequest* req,
      inference::RepositoryModelLoadResponse* resp) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* ctx, const inference::RepositoryModelUnloadRequest* req,
      inference::RepositoryModelUnloadResponse* resp) override;
  // Triton's CUDA shared-memory extension (server/cuda_shared_memory.h): served where every
  // worker reaches CUDA memory (ServedModel::workers_read_cuda), else UNIMPLEMENTED with why.
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryStatusRequest* req,
      inference::CudaSharedMemoryStatusResponse* resp) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryRegisterRequest* req,
      inference::CudaSharedMemoryRegisterResponse* resp) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest* req,
      inference::CudaSharedMemoryUnregisterResponse* resp) override;
  EPSERVE_UNIMPLEMENTED_RPC(TraceSetting)
  EPSERVE_UNIMPLEMENTED_RPC(LogSettings)
#undef EPSERVE_UNIMPLEMENTED_RPC

 private:
  class StreamInfer;
  class UnaryInfer;
  // A call that holds budget and may have an answer waiting for its client: what the reaper
  // looks at. Registered from its start to its OnDone.
  struct HeldCall {
    grpc::CallbackServerContext* ctx = nullptr;
    std::string peer;
    std::atomic<int64_t> held{0};               // bytes charged, not yet released
    std::atomic<int64_t> answer_waiting_ns{0};  // since when (unix ns) an answer waits; 0: none
  };
  void Register(HeldCall* call);
  void Forget(HeldCall* call);
  // The reaper's thread: closes calls whose answer is not taken within answer_timeout, and
  // under memory pressure the longest-waiting ones; returns freed memory to the system.
  void Reap();
  // Parses `request` and admits it: the server ready, the model in service, the bytes of the
  // request and its answer charged to the budget (*cost). On error nothing is charged.
  absl::StatusOr<ParsedInfer> Admit(const inference::ModelInferRequest& request, int64_t* cost);
  absl::Status CheckModel(const std::string& name, const std::string& version) const;
  absl::Status CheckRepository(const std::string& repository, const std::string& model) const;
  grpc::ServerUnaryReactor* Unimplemented(grpc::CallbackServerContext* ctx, const char* rpc);
  void BuildModelConfig();

  const ServiceOptions& options_;
  const ServedModel& model_;
  const ModelSignature signature_;  // refers to model_ and the request options
  Batcher& batcher_;
  Metrics* const metrics_;
  Statistics& statistics_;
  const std::shared_ptr<const Authenticator> auth_;
  inference::ModelConfig model_config_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> unloaded_{false};  // RepositoryModelUnload took the model out of service
  WeightLoader weight_loader_;
  // RepositoryModelLoad with new weights runs on a thread of its own (it takes seconds), one
  // at a time; the destructor joins it.
  std::mutex load_mu_;
  bool loading_ = false;  // guarded by load_mu_
  std::thread load_thread_;
  MemoryBudget budget_;
  SharedMemoryRegistry shm_;
  CudaSharedMemoryRegistry cuda_shm_;
  // Held across a registration's look into the other kind's registry and its own Register,
  // so that one name never ends up in both (one name space, as in Triton).
  std::mutex region_names_mu_;
  // Registered calls. A recursive mutex: the reaper cancels calls while holding it, and gRPC
  // may run the cancelled call's callbacks (OnDone -> Forget) inline on the reaper's thread.
  std::recursive_mutex calls_mu_;
  std::unordered_set<HeldCall*> calls_;                     // guarded by calls_mu_
  std::unordered_map<std::string, int64_t> calls_by_peer_;  // guarded by calls_mu_
  std::atomic<uint64_t> admitted_{0};  // requests that reached Admit (the reaper's trim rule)
  std::mutex reap_mu_;
  std::condition_variable reap_cv_;
  bool reap_stop_ = false;      // guarded by reap_mu_
  bool reap_pressure_ = false;  // guarded by reap_mu_: a request did not fit the budget
  std::thread reaper_;
};

}  // namespace epserve::server
