#include "server/service.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/parallel.h"
#include "server/clip.h"
#include "server/grpc_status.h"
#include "shmem/cuda_device.h"

namespace epserve::server {
namespace {

int64_t NowNs() { return absl::ToUnixNanos(absl::Now()); }

absl::Time DeadlineOf(const grpc::CallbackServerContext& ctx) {
  const auto d = ctx.deadline();
  return d == std::chrono::system_clock::time_point::max() ? absl::InfiniteFuture()
                                                           : absl::FromChrono(d);
}

using Regions = std::vector<std::shared_ptr<const SharedMemoryRegion>>;

// Adds output `name` of `datatype`, shape [num_tokens, width], to `resp` and returns where its
// bytes go: the shared memory the request placed it in (appended to `used`; its
// raw_output_contents entry stays empty, so that entries keep lining up with outputs), or its
// raw_output_contents entry, sized.
char* AddOutput(const char* name, absl::string_view datatype, int64_t num_tokens, int64_t width,
                size_t element_bytes, const ShmPlace& shm, inference::ModelInferResponse* resp,
                Regions* used) {
  auto* out = resp->add_outputs();
  out->set_name(name);
  out->set_datatype(std::string(datatype));
  out->add_shape(num_tokens);
  out->add_shape(width);
  std::string* raw = resp->add_raw_output_contents();
  if (shm.cuda != nullptr) return nullptr;  // the workers write it (InferTask::device_output)
  if (shm.region != nullptr) {
    used->push_back(shm.region);
    return shm.data;
  }
  raw->resize(static_cast<size_t>(num_tokens * width) * element_bytes);
  return raw->data();
}

// The outputs `parsed` asks for, added to `resp` in the order moe_output, topk_ids,
// topk_weights (`hidden` and `top_k` wide), and where the task writes them: task->output
// (into task->unrequested_output when moe_output is not asked for), topk_ids, topk_weights.
void AddOutputs(const ParsedInfer& parsed, int64_t hidden, int64_t top_k,
                inference::ModelInferResponse* resp, InferTask* task, Regions* used) {
  const int64_t t = parsed.num_tokens;
  if (parsed.want_output) {
    task->output = AddOutput(kOutputName, common::KServeName(parsed.output_type), t, hidden,
                             ElementBytes(parsed.output_type), parsed.output_shm, resp, used);
  } else {
    task->unrequested_output.resize(static_cast<size_t>(t * hidden) *
                                    ElementBytes(parsed.output_type));
    task->output = task->unrequested_output.data();
  }
  if (parsed.want_topk_ids) {
    task->topk_ids = reinterpret_cast<int32_t*>(
        AddOutput(kTopkIdsName, "INT32", t, top_k, 4, parsed.topk_ids_shm, resp, used));
  }
  if (parsed.want_topk_weights) {
    task->topk_weights = reinterpret_cast<float*>(
        AddOutput(kTopkWeightsName, "FP32", t, top_k, 4, parsed.topk_weights_shm, resp, used));
  }
}

// Where a tensor placed in CUDA shared memory is, for the workers.
worker::DeviceRows DeviceRowsOf(const ShmPlace& place, common::ElementType type) {
  worker::DeviceRows rows;
  rows.region_id = place.cuda->id();
  rows.offset = place.cuda_offset;
  rows.type = type;
  std::memcpy(rows.handle, place.cuda->handle().data(), sizeof(rows.handle));
  return rows;
}

// Where a tensor placed in system shared memory at `at` is, for workers that take such rows
// themselves: rank 0's descriptor of the object and the offset in it.
worker::DeviceRows HostRowsOf(const SharedMemoryRegion& region, const char* at,
                              common::ElementType type) {
  worker::DeviceRows rows;
  rows.region_id = region.id();
  rows.offset = region.ObjectOffset(at);
  rows.type = type;
  rows.set_host_shm({.pid = getpid(), .fd = region.fd()});
  return rows;
}

// The task's rows in clients' memory, for the workers: in CUDA regions (kept registered, and
// so open, while the task lives, by `cuda_used`: the workers move the rows, rank 0 holds no
// address of them), and in system shared memory where the workers take such rows themselves
// (`workers_read_shm`; kept mapped, and its descriptor open, by the task's `used` regions).
void PlaceClientRows(const ParsedInfer& parsed, bool workers_read_shm, InferTask* task,
                     std::vector<std::shared_ptr<const CudaSharedMemoryRegion>>* cuda_used) {
  if (parsed.input_cuda.cuda != nullptr) {
    task->device_input = DeviceRowsOf(parsed.input_cuda, parsed.input_type);
    cuda_used->push_back(parsed.input_cuda.cuda);
  }
  if (parsed.want_output && parsed.output_shm.cuda != nullptr) {
    task->device_output = DeviceRowsOf(parsed.output_shm, parsed.output_type);
    cuda_used->push_back(parsed.output_shm.cuda);
  }
  if (workers_read_shm && parsed.input_region != nullptr) {
    task->device_input = HostRowsOf(*parsed.input_region, parsed.input, parsed.input_type);
  }
  if (workers_read_shm && parsed.want_output && parsed.output_shm.region != nullptr) {
    task->device_output =
        HostRowsOf(*parsed.output_shm.region, parsed.output_shm.data, parsed.output_type);
  }
}

// Why CUDA shared memory cannot be served with these workers; empty where it can.
std::string CudaUnavailableReason(const ServedModel& model) {
  if (!shmem::CudaDevice::Built()) {
    return "this build has no CUDA driver API (built without the CUDA toolkit's cuda.h); "
           "register system shared memory instead (SystemSharedMemoryRegister)";
  }
  if (!model.workers_read_cuda) {
    return absl::StrCat("the workers' devices (--device=", model.device,
                        ") cannot reach CUDA memory: only workers on CUDA GPUs read a client's "
                        "rows from its GPU; register system shared memory instead "
                        "(SystemSharedMemoryRegister)");
  }
  return "";
}

}  // namespace

InferenceService::InferenceService(const ServiceOptions& options, const ServedModel& model,
                                   const RequestOptions& requests, int64_t budget_bytes,
                                   Batcher& batcher, Metrics* metrics, Statistics& statistics,
                                   std::shared_ptr<const Authenticator> auth)
    : options_(options),
      model_(model),
      signature_(model, requests),
      batcher_(batcher),
      metrics_(metrics),
      statistics_(statistics),
      auth_(auth ? std::move(auth) : std::make_shared<const Authenticator>("")),
      budget_(budget_bytes),
      cuda_shm_(CudaUnavailableReason(model)) {
  if (CudaUnavailableReason(model).empty()) {
    cuda_shm_.set_available(DriverCudaMemoryOpener());
  }
  BuildModelConfig();
  if (metrics_ != nullptr) metrics_->SetHeldBytesLimit(budget_.limit());
  reaper_ = std::thread([this] {
    common::NameThisThread("ep-reaper");
    Reap();
  });
}

InferenceService::~InferenceService() {
  if (load_thread_.joinable()) load_thread_.join();
  {
    std::lock_guard<std::mutex> lock(reap_mu_);
    reap_stop_ = true;
  }
  reap_cv_.notify_all();
  reaper_.join();
}

void InferenceService::ReleaseHeld(int64_t bytes) {
  if (bytes == 0) return;
  budget_.Release(bytes);
  if (metrics_ != nullptr) metrics_->SetHeldBytes(budget_.used());
}

void InferenceService::Register(HeldCall* call) {
  call->peer = call->ctx->peer();
  std::lock_guard<std::recursive_mutex> lock(calls_mu_);
  calls_.insert(call);
  ++calls_by_peer_[call->peer];
}

void InferenceService::Forget(HeldCall* call) {
  std::lock_guard<std::recursive_mutex> lock(calls_mu_);
  if (calls_.erase(call) == 0) return;
  auto it = calls_by_peer_.find(call->peer);
  if (it != calls_by_peer_.end() && --it->second == 0) calls_by_peer_.erase(it);
}

int64_t InferenceService::CallsOf(const std::string& peer) {
  std::lock_guard<std::recursive_mutex> lock(calls_mu_);
  auto it = calls_by_peer_.find(peer);
  return it == calls_by_peer_.end() ? 0 : it->second;
}

void InferenceService::Reap() {
  const absl::Duration grace = std::min(absl::Seconds(1), options_.answer_timeout);
  const int64_t limit = budget_.limit();
  absl::Time last_look = absl::Now();
  uint64_t admitted_at_look = admitted_.load();
  std::unique_lock<std::mutex> lock(reap_mu_);
  while (!reap_stop_) {
    reap_cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (reap_stop_) break;
    const bool pressure = reap_pressure_ || budget_.used() > limit - limit / 8;
    reap_pressure_ = false;
    lock.unlock();
    const int64_t now = NowNs();
    {
      std::lock_guard<std::recursive_mutex> calls(calls_mu_);
      std::vector<std::pair<int64_t, HeldCall*>> waiting;  // (since, call)
      for (HeldCall* c : calls_) {
        const int64_t since = c->answer_waiting_ns.load();
        if (since != 0) waiting.push_back({since, c});
      }
      std::sort(waiting.begin(), waiting.end());
      // Callbacks of a cancelled call may run right here (Forget on this thread), so the
      // candidates are picked first and each is checked to be registered before it is
      // cancelled.
      int64_t to_free = pressure ? budget_.used() - limit / 2 : 0;
      for (const auto& [since, c] : waiting) {
        const absl::Duration waited = absl::Nanoseconds(now - since);
        const char* reason = nullptr;
        if (waited >= options_.answer_timeout) {
          reason = "answer_timeout";
        } else if (to_free > 0 && waited >= grace) {
          reason = "memory_pressure";
        } else {
          continue;
        }
        if (calls_.count(c) == 0) continue;
        to_free -= c->held.load();
        if (metrics_ != nullptr) metrics_->ObserveCallClosed(reason);
        c->ctx->TryCancel();
      }
    }
    // Memory given back: glibc keeps freed buffers in its arenas (request and answer buffers
    // under its mmap threshold, and gRPC's own: a message refused at its size bound, the
    // streams of a burst, which the budget never sees). Once a second, while its arenas hold
    // 32 MiB or more of free chunks, their pages go back to the system; with
    // keep_request_buffers only once no request arrived since the last look (the load
    // ended) or when they hold over twice what the calls hold (at least 64 MiB), so that
    // under load the next requests reuse them without faulting their pages in again. A trim
    // of pages already given back costs a walk of the free lists, well under a millisecond.
    if (absl::Now() - last_look >= absl::Seconds(1)) {
      last_look = absl::Now();
      const uint64_t admitted = admitted_.load(std::memory_order_relaxed);
      const bool quiet = admitted == admitted_at_look;
      admitted_at_look = admitted;
      const size_t free_bytes = mallinfo2().fordblks;
      const size_t held = static_cast<size_t>(std::max<int64_t>(budget_.used(), 64 << 20));
      const bool give_back = !options_.keep_request_buffers || quiet || free_bytes > 2 * held;
      if (free_bytes >= (size_t{32} << 20) && give_back) malloc_trim(0);
    }
    lock.lock();
  }
}

void ConfigureAllocator(bool keep_request_buffers) {
  // A fixed threshold also turns off glibc's adaptive ones, which after the first free of an
  // mmapped buffer serve every size up to it from the arenas, where a burst stays resident.
  mallopt(M_MMAP_THRESHOLD, keep_request_buffers ? 32 << 20 : 4 << 20);
  mallopt(M_TRIM_THRESHOLD, keep_request_buffers ? 1 << 30 : 4 << 20);
}

absl::StatusOr<ParsedInfer> InferenceService::Admit(const inference::ModelInferRequest& req,
                                                    int64_t* cost) {
  admitted_.fetch_add(1, std::memory_order_relaxed);  // a request arrived (the reaper's trims)
  absl::StatusOr<ParsedInfer> parsed = ParseInfer(req, signature_, &shm_, &cuda_shm_);
  if (!parsed.ok()) return parsed.status();
  if (!ready()) {
    return absl::UnavailableError("the server is not ready (starting, stopping or unhealthy)");
  }
  if (unloaded_.load()) {
    return absl::NotFoundError(absl::StrCat("model '", signature_.name,
                                            "' is unloaded (RepositoryModelUnload); "
                                            "RepositoryModelLoad puts it back into service"));
  }
  // The request's message and its answer (the outputs it asks for, or the layer output held
  // for the routing alone) are charged until the answer is sent.
  const int64_t k = signature_.top_k;
  const bool shm_out = parsed->want_output && parsed->output_shm.placed();
  const int64_t bytes = static_cast<int64_t>(req.ByteSizeLong()) +
                        parsed->num_tokens * ((shm_out ? 0 : signature_.hidden_size * 4) + 8 * k);
  if (!budget_.TryCharge(bytes)) {
    absl::Status full = absl::ResourceExhaustedError(absl::StrCat(
        "the server holds ", budget_.used(), " bytes of requests and answers; this request's ",
        bytes, " more would exceed --max-inflight-bytes=", budget_.limit()));
    {
      std::lock_guard<std::mutex> lock(reap_mu_);
      reap_pressure_ = true;
    }
    reap_cv_.notify_one();
    return full;
  }
  if (metrics_ != nullptr) metrics_->SetHeldBytes(budget_.used());
  *cost = bytes;
  return parsed;
}

absl::Status InferenceService::Submit(const inference::ModelInferRequest& req,
                                      inference::ModelInferResponse* resp, absl::Time start,
                                      absl::Time deadline, std::function<bool()> cancelled,
                                      std::function<void(absl::Status)> done, int64_t* charged) {
  *charged = 0;
  if (metrics_ != nullptr) metrics_->RequestStarted();  // every path below observes it once
  int64_t cost = 0;
  absl::StatusOr<ParsedInfer> parsed = Admit(req, &cost);
  if (!parsed.ok()) {
    if (metrics_ != nullptr) {
      metrics_->ObserveRequest(parsed.status().code(), absl::Now() - start, absl::ZeroDuration(),
                               0);
    }
    if (!absl::IsNotFound(parsed.status())) {
      statistics_.ObserveRequest(parsed.status(), absl::Now() - start, {});
    }
    return parsed.status();
  }
  resp->set_model_name(signature_.name);
  resp->set_model_version("1");
  resp->set_id(req.id());
  auto task = std::make_shared<InferTask>();
  // The shared memory regions the request reads or writes (kept mapped by the task).
  std::vector<std::shared_ptr<const SharedMemoryRegion>> used;
  AddOutputs(*parsed, signature_.hidden_size, signature_.top_k, resp, task.get(), &used);
  if (parsed->input_region != nullptr) used.push_back(parsed->input_region);
  std::vector<std::shared_ptr<const CudaSharedMemoryRegion>> cuda_used;
  PlaceClientRows(*parsed, model_.workers_read_shm, task.get(), &cuda_used);

  task->layer_pos = parsed->layer_pos;
  task->num_tokens = parsed->num_tokens;
  task->priority = parsed->priority;
  task->input = parsed->input;
  task->input_type = parsed->input_type;
  task->output_type = parsed->output_type;
  task->enqueued = start;
  task->deadline = std::min(deadline, start + parsed->timeout);
  task->cancelled = std::move(cancelled);
  task->done = [this, start, tokens = parsed->num_tokens, used = std::move(used),
                cuda_used = std::move(cuda_used),
                done = std::move(done)](absl::Status s, const TaskTimes& times) {
    // The task holds this callback until it is destroyed, so `used` keeps the regions the
    // input and outputs point into mapped while the batcher uses them. A region its owner
    // shrank meanwhile (shared_memory.h): the rows are not what the client meant, so the
    // answer is an error.
    for (const auto& region : used) {
      if (s.ok()) s = region->CheckIntact("a tensor in shared memory");
    }
    const absl::Duration total = absl::Now() - start;
    if (metrics_ != nullptr) metrics_->ObserveRequest(s.code(), total, times.queue, tokens);
    statistics_.ObserveRequest(s, total, times);
    done(std::move(s));
  };
  *charged = cost;  // before the batcher may answer
  absl::Status status = batcher_.Enqueue(task);
  // epserve_queue_tokens, refreshed as batches start and end, and here, so that it also shows
  // rows waiting while no batch runs (for a fuller batch, up to --max-queue-delay-us).
  if (status.ok() && metrics_ != nullptr) metrics_->SetQueueTokens(batcher_.queued_tokens());
  if (!status.ok()) {
    *charged = 0;
    ReleaseHeld(cost);
    if (metrics_ != nullptr) {
      metrics_->ObserveRequest(status.code(), absl::Now() - start, absl::ZeroDuration(), 0);
    }
    statistics_.ObserveRequest(status, absl::Now() - start, {});
  }
  return status;
}

// One ModelInfer call: holds its budget until gRPC has sent the answer (or the call ended
// without it), and is registered so that the reaper can close it when the answer is not
// taken. Deletes itself in OnDone.
class InferenceService::UnaryInfer final : public grpc::ServerUnaryReactor {
 public:
  UnaryInfer(InferenceService& service, grpc::CallbackServerContext* ctx) : service_(service) {
    call_.ctx = ctx;
    service_.Register(&call_);
  }

  void Start(const inference::ModelInferRequest& req, inference::ModelInferResponse* resp) {
    const absl::Time start = absl::Now();
    grpc::CallbackServerContext* ctx = call_.ctx;
    if (absl::Status s = service_.auth_->Check(*ctx); !s.ok()) return Answer(s);
    absl::Status s = service_.Submit(
        req, resp, start, DeadlineOf(*ctx), [ctx] { return ctx->IsCancelled(); },
        [this](absl::Status status) { Answer(status); }, &charged_);
    if (!s.ok()) Answer(s);  // (on OK the call may be answered and gone by now)
  }

  void OnDone() override {
    service_.Forget(&call_);
    service_.ReleaseHeld(charged_);
    delete this;
  }

 private:
  void Answer(const absl::Status& status) {
    call_.held.store(charged_);
    call_.answer_waiting_ns.store(NowNs());
    Finish(ToGrpcStatus(status));
  }

  InferenceService& service_;
  HeldCall call_;
  int64_t charged_ = 0;  // set by Submit before the request is queued
};

grpc::ServerUnaryReactor* InferenceService::ModelInfer(grpc::CallbackServerContext* ctx,
                                                       const inference::ModelInferRequest* req,
                                                       inference::ModelInferResponse* resp) {
  auto* call = new UnaryInfer(*this, ctx);
  call->Start(*req, resp);
  return call;
}

// One ModelStreamInfer call. Reads requests while fewer than max_stream_inflight are
// unanswered, answers each (in completion order) with its id, a failed one with
// error_message, and ends once the client has half-closed and every answer is written.
// Deletes itself in OnDone.
class InferenceService::StreamInfer final
    : public grpc::ServerBidiReactor<inference::ModelInferRequest,
                                     inference::ModelStreamInferResponse> {
 public:
  StreamInfer(InferenceService& service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    call_.ctx = ctx;
    service_.Register(&call_);
    if (absl::Status s = service_.auth_->Check(*ctx); !s.ok()) {
      finished_ = true;
      Finish(ToGrpcStatus(s));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ReadNext();
  }

  void OnReadDone(bool ok) override {
    std::unique_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      if (!ok) {
        reads_done_ = true;
        next_.reset();
        MaybeFinish();
        return;
      }
      slot = std::move(next_);
      ++inflight_;
    }
    Slot* raw = slot.release();  // owned by the stream until written
    const absl::Time start = absl::Now();
    grpc::CallbackServerContext* ctx = ctx_;
    absl::Status s = service_.Submit(
        *raw->request, raw->response.mutable_infer_response(), start, DeadlineOf(*ctx),
        [ctx] { return ctx->IsCancelled(); },
        [this, raw](absl::Status status) { Answer(raw, std::move(status)); }, &raw->charged);
    if (!s.ok()) Answer(raw, std::move(s));  // (on OK `raw` may be written and gone by now)
    std::lock_guard<std::mutex> lock(mu_);
    if (inflight_ < service_.options_.max_stream_inflight) ReadNext();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    call_.answer_waiting_ns.store(0);
    Drop(*written_.front());
    written_.pop_front();
    --inflight_;
    if (!ok) broken_ = true;
    Pump();
    if (!reads_done_ && !reading_ && inflight_ < service_.options_.max_stream_inflight) {
      ReadNext();
    }
    MaybeFinish();
  }

  void OnDone() override {
    service_.Forget(&call_);
    delete this;
  }

 private:
  struct Slot {
    std::unique_ptr<inference::ModelInferRequest> request =
        std::make_unique<inference::ModelInferRequest>();
    inference::ModelStreamInferResponse response;
    int64_t charged = 0;  // budget bytes (set by Submit), released once written or dropped
  };

  // Releases what `slot` holds of the budget.
  void Drop(Slot& slot) {
    service_.ReleaseHeld(slot.charged);
    call_.held.fetch_sub(slot.charged);
    slot.charged = 0;
  }

  void Answer(Slot* raw, absl::Status status) {
    std::unique_ptr<Slot> slot(raw);
    if (!status.ok()) {
      const inference::ModelInferRequest& q = *slot->request;
      inference::ModelInferResponse* r = slot->response.mutable_infer_response();
      r->Clear();
      r->set_model_name(Clip(q.model_name()));
      r->set_model_version(Clip(q.model_version()));
      if (q.id().size() <= kMaxRequestIdBytes) r->set_id(q.id());
      slot->response.set_error_message(
          absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
    }
    slot->request.reset();  // the input is no longer needed: its memory goes now
    call_.held.fetch_add(slot->charged);
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(slot));
    Pump();
    MaybeFinish();
  }

  void ReadNext() {  // holds mu_
    if (reading_ || reads_done_ || finished_) return;
    next_ = std::make_unique<Slot>();
    reading_ = true;
    StartRead(next_->request.get());
  }

  void Pump() {  // holds mu_
    while (!writing_ && !pending_.empty()) {
      std::unique_ptr<Slot> slot = std::move(pending_.front());
      pending_.pop_front();
      if (broken_ || finished_) {  // nobody to write to: drop the answer
        Drop(*slot);
        --inflight_;
        continue;
      }
      written_.push_back(std::move(slot));
      writing_ = true;
      call_.answer_waiting_ns.store(NowNs());
      StartWrite(&written_.back()->response);
    }
  }

  void MaybeFinish() {  // holds mu_
    if (finished_ || inflight_ > 0 || writing_ || reading_) return;
    if (!reads_done_ && !broken_) return;
    finished_ = true;
    Finish(ctx_->IsCancelled() ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  InferenceService& service_;
  grpc::CallbackServerContext* const ctx_;
  HeldCall call_;
  std::mutex mu_;
  std::unique_ptr<Slot> next_;                 // the read in flight
  std::deque<std::unique_ptr<Slot>> pending_;  // answered, waiting for the write
  std::deque<std::unique_ptr<Slot>> written_;  // the write in flight
  int inflight_ = 0;                           // read and not yet written or dropped
  bool reading_ = false;
  bool reads_done_ = false;
  bool writing_ = false;
  bool broken_ = false;
  bool finished_ = false;
};

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
InferenceService::ModelStreamInfer(grpc::CallbackServerContext* ctx) {
  return new StreamInfer(*this, ctx);
}

absl::Status ServiceOptions::Validate() const {
  if (max_stream_inflight < 1) {
    return absl::InvalidArgumentError("--max-stream-inflight must be >= 1");
  }
  if (max_inflight_bytes < 0) {
    return absl::InvalidArgumentError("--max-inflight-bytes must be >= 0 (0: derived)");
  }
  if (answer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--answer-timeout must be > 0");
  }
  return absl::OkStatus();
}

}  // namespace epserve::server
