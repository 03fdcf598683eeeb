// An expert worker: creation, its buffers and its serve loop (Serve, RunBatch and the
// stages of a batch through the exchange). Its weights are in worker_weights.cc, its local
// run in worker_local.cc, its device path in worker_device.cc.
#include "worker/worker.h"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"
#include "model/layers.h"
#include "worker/detail/timing.h"

namespace epserve::worker {
using detail::NanosSince;

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(shmem::SymmetricHeap& heap,
                                                       const HeapRegions& regions,
                                                       const model::WeightSource& source,
                                                       const WorkerOptions& options) {
  std::unique_ptr<Worker> w(new Worker(heap, regions, source.config(), options));
  w->rank_ = heap.rank();
  w->me_ = WorkerOfRank(heap.rank());
  w->live_ = WorkerSet::All(regions.plan.shape().num_workers);
  w->orphan_grace_ = options.orphan_grace;
  const int ranks_on_host = std::max(options.workers_on_host, 1) + 1;
  w->idle_poll_ = options.idle_poll > absl::ZeroDuration() ? options.idle_poll
                  : common::ThreadsToSpare(ranks_on_host)  ? absl::Microseconds(20)
                                                           : absl::Microseconds(200);
  absl::StatusOr<std::unique_ptr<Exchange>> exchange =
      Exchange::Create(heap, regions.plan, regions.exchange, w->me_);
  if (!exchange.ok()) return exchange.status();
  w->exchange_ = *std::move(exchange);
  w->host_threads_ = options.host_threads > 0
                         ? options.host_threads
                         : std::clamp(static_cast<int>(std::thread::hardware_concurrency()) /
                                          (std::max(options.workers_on_host, 1) + 1),
                                      1, 8);
  w->exchange_->set_reduce_threads(w->host_threads_);
  const size_t num_layers = source.config().moe_layers.size();
  w->placements_ = options.placements.empty()
                       ? std::vector<ExpertPlacement>(num_layers, w->exchange_->placement())
                       : options.placements;
  EPSERVE_RETURN_IF_ERROR(w->CheckPlacements(w->placements_));
  // The device's large host transfers (staged through pinned memory) on the same host threads.
  kernels::RuntimeOptions device = options.device;
  if (device.transfer_threads == 0) device.transfer_threads = w->host_threads_;
  absl::StatusOr<std::unique_ptr<kernels::Runtime>> rt = kernels::Runtime::Create(device);
  if (!rt.ok()) return rt.status();
  w->rt_ = *std::move(rt);
  EPSERVE_ASSIGN_OR_RETURN(w->layers_, w->LoadLayers(source, w->placements_));
  EPSERVE_RETURN_IF_ERROR(w->AllocateBuffers());
  EPSERVE_RETURN_IF_ERROR(w->StartCudaRows());
  EPSERVE_RETURN_IF_ERROR(w->StartHostRows());
  EPSERVE_RETURN_IF_ERROR(w->StartDeviceExchange());
  const absl::Time warm_start = absl::Now();
  EPSERVE_RETURN_IF_ERROR(w->WarmUp());
  w->warmup_seconds_ = absl::ToDoubleSeconds(absl::Now() - warm_start);
  return w;
}

absl::Status Worker::CheckPlacements(const std::vector<ExpertPlacement>& placements) {
  if (placements.size() != model_.moe_layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat(placements.size(), " placements for ",
                                                   model_.moe_layers.size(), " served layers"));
  }
  for (const ExpertPlacement& p : placements) EPSERVE_RETURN_IF_ERROR(exchange_->UsePlacement(p));
  return absl::OkStatus();
}

Worker::~Worker() {
  if (loader_.joinable()) loader_.join();
  device_exchange_.reset();  // its buffers before the runtime they were made on
}

std::string Worker::exchange_path() const { return exchange_path_; }

std::string Worker::ffn_blocking() const {
  std::vector<std::string> parts;
  for (const kernels::FfnChoice& c : rt_->ffn_choices()) parts.push_back(c.Describe());
  return parts.empty() ? std::string("none (no portable FFN kernels in use)")
                       : absl::StrJoin(parts, " | ");  // a plan's classes are "; " apart
}

const char* Worker::ffn_kernels() const {
  return layers_.empty() ? "none" : kernels::FfnKernelsName(*rt_, layers_.front().experts);
}

size_t Worker::weight_bytes() const {
  size_t bytes = 0;
  for (const Layer& l : layers_) bytes += LayerBytes(l);
  return bytes;
}

absl::Status Worker::AllocateBuffers() {
  const ExchangePlan& plan = regions_.plan;
  const size_t f = sizeof(float);
  const size_t h = static_cast<size_t>(cfg_.hidden_size);
  const size_t k = static_cast<size_t>(cfg_.top_k);
  const size_t n = static_cast<size_t>(plan.max_rows_per_worker());
  const size_t r = static_cast<size_t>(plan.recv_capacity());
  const size_t pairs = r * k;
  // The shared expert runs on this worker's own rows, or (split) its slice on every row it
  // receives.
  const bool split = plan.shared_expert_split();
  const size_t shared_rows = split ? r : n;
  const size_t shared_f =
      layers_.empty() ? 1 : static_cast<size_t>(std::max<int64_t>(layers_[0].shared.ffn, 1));
  struct Item {
    kernels::Buffer* buffer;
    size_t bytes;
  };
  const Item items[] = {
      {&x_local_, n * h * f},
      {&ids_, n * k * sizeof(int32_t)},
      {&weights_, n * k * f},
      {&shared_h_, shared_rows * shared_f * f},
      {&shared_y_, shared_rows * h * f},
      {&x_recv_, r * std::max(h * f, plan.dispatch_row_bytes())},
      {&row_index_, pairs * sizeof(int32_t)},
      {&h_, pairs * static_cast<size_t>(cfg_.expert_ffn_size) * f},
      {&y_, pairs * h * f},
  };
  for (const Item& item : items) {
    absl::StatusOr<kernels::Buffer> b = rt_->Allocate(std::max<size_t>(item.bytes, 64));
    if (!b.ok()) return b.status();
    *item.buffer = *std::move(b);
  }
  // The uploader reads its signal and the input slots with loads (the shm heap).
  upload_ahead_ = heap_.backend() == shmem::HeapBackend::kShm &&
                  (options_.upload_ahead == AutoSwitch::kOn ||
                   (options_.upload_ahead == AutoSwitch::kAuto && !rt_->device_info().is_cpu));
  if (upload_ahead_) {
    EPSERVE_ASSIGN_OR_RETURN(x_next_, rt_->Allocate(std::max<size_t>(n * h * f, 64)));
  }
  EPSERVE_ASSIGN_OR_RETURN(
      void* pinned, rt_->AllocatePinnedHost((2 * n * k + cfg_.num_experts + 1) * sizeof(int32_t)));
  ids_host_ = {static_cast<int32_t*>(pinned), n * k};
  weights_host_ = {reinterpret_cast<float*>(ids_host_.data() + n * k), n * k};
  pair_counts_host_ = ids_host_.data() + 2 * n * k;
  if (plan.dispatch_dtype() == common::ElementType::kFp8E4m3 ||
      (plan.dispatch_dtype() == common::ElementType::kBf16 && split) ||
      (plan.dispatch_dtype() == common::ElementType::kFp32 && plan.dispatch_row_bytes() != h * f)) {
    x_recv_host_.resize(r * h);
  }
  if (heap_.Direct(0, regions_.output) == nullptr) y_host_.resize(n * h);
  return absl::OkStatus();
}

// Advances this worker's heartbeat in rank 0's segment every kHeartbeatInterval from a thread
// of its own, for as long as it exists, so that rank 0 tells a stopped or wedged worker
// (Coordinator::StalledWorkers) from a busy one. Nothing where rank 0's segment has no
// load/store view (the rma backend: MPI is called from the batch thread only).
class Worker::Heart {
 public:
  explicit Heart(uint64_t* beat) {
    if (beat == nullptr) return;
    thread_ = std::thread([this, beat] {
      common::NameThisThread("ep-heartbeat");
      uint64_t n = 0;
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        std::atomic_ref<uint64_t>(*beat).store(++n, std::memory_order_relaxed);
        cv_.wait_for(lock, absl::ToChronoNanoseconds(HeapRegions::kHeartbeatInterval));
      }
    });
  }
  ~Heart() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

bool Worker::FrontEndDied() {
  // Only where every rank is on this host (shm): rank 0's pid names a process here.
  if (heap_.backend() != shmem::HeapBackend::kShm) return false;
  const uint64_t* pid = heap_.DirectAs<uint64_t>(0, regions_.front_end_pid);
  if (pid == nullptr) return false;
  const uint64_t p = shmem::SignalLoad(const_cast<uint64_t*>(pid));
  if (p == 0 || kill(static_cast<pid_t>(p), 0) == 0 || errno != ESRCH) return false;
  front_end_lost_ = true;
  return true;
}

absl::Status Worker::Serve(const std::atomic<bool>& stop) {
  const Heart heart(heap_.backend() == shmem::HeapBackend::kShm
                        ? heap_.DirectAs<uint64_t>(0, HeapRegions::Signal(regions_.heartbeats, me_))
                        : nullptr);
  EPSERVE_RETURN_IF_ERROR(
      heap_.SignalSet(0, HeapRegions::Signal(regions_.pids, me_), static_cast<uint64_t>(getpid())));
  EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(
      0, HeapRegions::Signal(regions_.ready, me_),
      HeapRegions::kReady | (cuda_rows_ != nullptr ? HeapRegions::kReadyReadsCuda : 0) |
          (host_rows_ != nullptr ? HeapRegions::kReadyReadsShm : 0)));
  // The uploader, from now until Serve returns.
  std::atomic<bool> uploader_stop{false};
  std::thread uploader;
  if (upload_ahead_) {
    uploader = std::thread([&] {
      common::NameThisThread("ep-upload-ahead");
      UploadLoop(uploader_stop);
    });
  }
  struct StopUploader {
    std::atomic<bool>& stop;
    std::thread& thread;
    std::condition_variable& cv;
    ~StopUploader() {
      stop.store(true);
      cv.notify_all();
      if (thread.joinable()) thread.join();
    }
  } stop_uploader{uploader_stop, uploader, ahead_cv_};
  uint64_t seq = 0;
  absl::Time stop_seen = absl::InfiniteFuture();
  shmem::WaitOptions idle;
  idle.max_sleep = idle_poll_;
  while (true) {
    absl::Status wait = heap_.WaitSignal(
        regions_.batch_seq, seq + 1, absl::Now() + absl::Milliseconds(250), "next batch", -1, idle);
    EPSERVE_RETURN_IF_ERROR(PublishStage());
    if (absl::IsDeadlineExceeded(wait)) {
      if (FrontEndDied()) {
        return absl::UnavailableError(
            "rank 0 (the front-end) died: leaving, so that the MPI job ends");
      }
      if (stop.load()) {
        if (stop_seen == absl::InfiniteFuture()) stop_seen = absl::Now();
        if (absl::Now() - stop_seen > orphan_grace_) {
          return absl::AbortedError("stop requested and rank 0 sent no batch; leaving");
        }
      }
      continue;
    }
    EPSERVE_RETURN_IF_ERROR(wait);
    seq = heap_.SignalLoad(regions_.batch_seq);
    const BatchDescriptor desc = *heap_.LocalAs<BatchDescriptor>(regions_.descriptor);
    WorkerReport report;
    std::memset(&report, 0, sizeof(report));
    if (desc.op != BatchOp::kStop) RunPosted(seq, desc, report);
    EPSERVE_RETURN_IF_ERROR(
        heap_.Put(0, regions_.reports + static_cast<size_t>(me_) * sizeof(WorkerReport), &report,
                  sizeof(report)));
    EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(0, HeapRegions::Signal(regions_.done_seq, me_), seq));
    EPSERVE_RETURN_IF_ERROR(PublishStage());
    if (desc.op == BatchOp::kStop) return absl::OkStatus();
  }
}

void Worker::RunPosted(uint64_t seq, const BatchDescriptor& desc, WorkerReport& report) {
  absl::Status s;
  switch (desc.op) {
    case BatchOp::kStage:
      s = Stage(seq);
      break;
    case BatchOp::kSwitch:
      s = EndStage(true);
      break;
    case BatchOp::kDiscard:
      s = EndStage(false);
      break;
    default:
      s = RunBatch(desc, report);
  }
  if (s.ok()) return;
  report.status_code = static_cast<int32_t>(s.code());
  const std::string msg = absl::StrCat("worker ", me_, " (rank ", rank_, "): ", s.message());
  std::strncpy(report.message, msg.c_str(), sizeof(report.message) - 1);
  if (absl::IsDeadlineExceeded(s)) common::LogError(absl::StrCat("batch ", seq, ": ", msg));
}

// The route stage (n > 0 rows): this worker's rows through the router; the routing goes to
// rank 0 too (outputs topk_ids, topk_weights), now, or with to_host false once the layer has
// run on the device (RunLocalOnDevice, SendRouting).
absl::Status Worker::Route(const Layer& layer, const BatchDescriptor& desc, float* x_in,
                           bool to_host) {
  const int64_t n = desc.num_rows;
  EPSERVE_RETURN_IF_ERROR(RowsOnDevice(desc, x_in));
  EPSERVE_RETURN_IF_ERROR(DeviceRowsIn(desc, x_in));
  EPSERVE_RETURN_IF_ERROR(kernels::Route(*rt_, layer.router, x_local_, n, ids_, weights_));
  return to_host ? SendRouting(desc) : absl::OkStatus();
}

// The router's ids and weights to the host and on to rank 0.
absl::Status Worker::SendRouting(const BatchDescriptor& desc) {
  const int k = cfg_.top_k;
  const int64_t n = desc.num_rows;
  EPSERVE_RETURN_IF_ERROR(rt_->Read(ids_, 0, ids_host_.data(), n * k * sizeof(int32_t)));
  EPSERVE_RETURN_IF_ERROR(rt_->Read(weights_, 0, weights_host_.data(), n * k * sizeof(float)));
  return PutRouting(desc);
}

absl::Status Worker::PutRouting(const BatchDescriptor& desc) {
  // The done signal completes these Puts.
  const int k = cfg_.top_k;
  const size_t routing_bytes = static_cast<size_t>(desc.num_rows * k) * sizeof(int32_t);
  const size_t at = static_cast<size_t>(desc.row_start * k) * sizeof(int32_t);
  EPSERVE_RETURN_IF_ERROR(
      heap_.Put(0, regions_.TopkIds(desc.slot) + at, ids_host_.data(), routing_bytes));
  return heap_.Put(0, regions_.TopkWeights(desc.slot) + at, weights_host_.data(), routing_bytes);
}

// The expert step of a batch (Exchange::ExpertStep): the rows this worker received through
// its experts' FFN, one output row per pair, plus the shared expert's slice on every row when
// it is split.
absl::Status Worker::ExpertStep(const Layer& layer, bool split_shared, const ReceivedRows& in,
                                float* pair_out, float* row_out) {
  const int64_t hidden = cfg_.hidden_size;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  if (in.rows == 0) return absl::OkStatus();
  if (in.on_device) {
    // The rows are in x_recv_ already (FP32); the outputs stay in y_ and shared_y_, from
    // where DeviceExchange::Return writes them into their owners' devices.
    if (in.pairs > 0) {
      EPSERVE_RETURN_IF_ERROR(rt_->Write(row_index_, 0, in.pair_row, in.pairs * sizeof(int32_t)));
      EPSERVE_RETURN_IF_ERROR(
          kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_, in.expert_offsets, h_, y_));
    }
    if (split_shared) {
      EPSERVE_RETURN_IF_ERROR(
          kernels::SharedExpertFfn(*rt_, layer.shared, x_recv_, in.rows, shared_h_, shared_y_));
    }
    return absl::OkStatus();  // DeviceMover::Return queues its moves behind these, then waits
  }
  // BF16 rows go to the device as they came (the FFN widens them exactly); others as fp32,
  // and so do BF16 rows when the shared expert's slice (FP32 input) runs on them too.
  kernels::RowFormat x_format;
  const void* rows = in.Fp32Rows();
  size_t rows_bytes = in.rows * row_bytes;
  if (in.dtype == common::ElementType::kBf16 && !split_shared) {
    rows = in.payload;
    rows_bytes = in.rows * in.row_bytes;
    x_format = {common::ElementType::kBf16, static_cast<int64_t>(in.row_bytes / sizeof(uint16_t))};
  } else if (rows == nullptr || !x_recv_host_.empty()) {
    in.Decode(0, in.rows, x_recv_host_.data());
    rows = x_recv_host_.data();
  }
  EPSERVE_RETURN_IF_ERROR(rt_->Write(x_recv_, 0, rows, rows_bytes));
  if (in.pairs > 0) {
    EPSERVE_RETURN_IF_ERROR(rt_->Write(row_index_, 0, in.pair_row, in.pairs * sizeof(int32_t)));
    EPSERVE_RETURN_IF_ERROR(kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_,
                                               in.expert_offsets, h_, y_, x_format));
  }
  if (split_shared) {
    EPSERVE_RETURN_IF_ERROR(
        kernels::SharedExpertFfn(*rt_, layer.shared, x_recv_, in.rows, shared_h_, shared_y_));
  }
  if (in.pairs > 0) EPSERVE_RETURN_IF_ERROR(rt_->Read(y_, 0, pair_out, in.pairs * row_bytes));
  if (split_shared) return rt_->Read(shared_y_, 0, row_out, in.rows * row_bytes);
  return absl::OkStatus();
}

// Pairs per expert this worker computed in the last batch: its row of rank 0's
// expert_tokens (every expert, so that a copy it no longer holds reads 0).
absl::Status Worker::PublishExpertLoad(const ExpertPlacement& placement,
                                       const ExchangeStats& stats) {
  const int num_experts = cfg_.num_experts;
  expert_tokens_.assign(num_experts, 0);
  for (size_t i = 0; i < stats.expert_pairs.size(); ++i) {
    expert_tokens_[placement.expert(me_, static_cast<int>(i))] += stats.expert_pairs[i];
  }
  return heap_.Put(
      0, regions_.expert_tokens + static_cast<size_t>(me_) * num_experts * sizeof(int64_t),
      expert_tokens_.data(), expert_tokens_.size() * sizeof(int64_t));
}

absl::StatusOr<const ExpertPlacement*> Worker::PlacementFor(const BatchDescriptor& desc,
                                                            const Layer& layer) {
  const int num_workers = regions_.plan.shape().num_workers;
  if (!(desc.live == live_)) {
    if (desc.live.Count() < num_workers) {
      common::LogWarning(absl::StrCat(
          "worker ", me_, ": serving with ", desc.live.Count(), " live workers of ", num_workers,
          " (lost: ", desc.live.Missing(num_workers).List(num_workers), ")"));
    }
    live_ = desc.live;
    survivor_placements_.clear();
  }
  if (live_.Count() == num_workers) return layer.placement;
  if (survivor_placements_.empty()) {
    for (const ExpertPlacement& p : placements_) {
      EPSERVE_ASSIGN_OR_RETURN(ExpertPlacement only, p.OnlyOn(live_));
      survivor_placements_.push_back(std::move(only));
    }
  }
  return &survivor_placements_[desc.layer_pos];
}

namespace {
// The exchange's stages and counts of a batch into the worker's report to rank 0.
void ReportStats(const ExchangeStats& stats, WorkerReport& report) {
  report.stage_ns[kLayout] = stats.layout_ns;
  report.stage_ns[kDispatch] = stats.dispatch_ns;
  report.stage_ns[kExpertFfn] = stats.expert_ns;
  report.stage_ns[kCombine] = stats.combine_ns;
  report.rows_received = stats.rows_received;
  report.pairs = stats.pairs;
}
}  // namespace

absl::Status Worker::RunBatch(const BatchDescriptor& desc, WorkerReport& report) {
  const int64_t hidden = cfg_.hidden_size;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t n = desc.num_rows;
  if (desc.layer_pos < 0 || desc.layer_pos >= static_cast<int>(layers_.size()) || n < 0 ||
      n > regions_.plan.max_rows_per_worker() || desc.slot < 0 ||
      desc.slot >= HeapRegions::kSlots) {
    return absl::InternalError(absl::StrCat("bad batch descriptor: layer_pos ", desc.layer_pos,
                                            ", rows ", n, ", slot ", desc.slot));
  }
  const Layer& layer = layers_[desc.layer_pos];
  const absl::Time deadline = absl::FromUnixMicros(desc.deadline_unix_us);
  client_rows_error_ = absl::OkStatus();
  float* x_in = heap_.LocalAs<float>(regions_.Input(desc.slot));
  ++batches_served_;

  absl::Time t0 = absl::Now();
  const bool local = RunsLocally(desc);
  const bool on_device = local && GroupsOnDevice(layer, n);
  if (n > 0) EPSERVE_RETURN_IF_ERROR(Route(layer, desc, x_in, /*to_host=*/!on_device));
  report.stage_ns[kRoute] = NanosSince(t0);

  // ---- exchange: count/notify (the `layout` stage), dispatch, expert FFN, combine ----
  // Output rows go straight into rank 0's segment when it is load/store.
  float* y = heap_.DirectAs<float>(0, regions_.Output(desc.slot));
  y = y != nullptr ? y + desc.row_start * hidden : y_host_.data();
  const bool has_shared = layer.shared.num_experts > 0;
  const bool split_shared = has_shared && regions_.plan.shared_expert_split();
  const bool owner_shared = has_shared && !split_shared;
  // The whole shared expert runs on the owner's own rows while peers dispatch; a slice of it
  // runs in the expert step on every received row.
  std::function<absl::Status()> shared;
  if (owner_shared) {
    shared = [&]() -> absl::Status {
      if (n == 0) return absl::OkStatus();
      EPSERVE_RETURN_IF_ERROR(
          kernels::SharedExpertFfn(*rt_, layer.shared, x_local_, n, shared_h_, shared_y_));
      // Device to device, the owner's sum adds onto shared_y_ where it is.
      if (exchange_->device_pass()) return absl::OkStatus();
      return rt_->Read(shared_y_, 0, y, n * row_bytes);
    };
  }
  const Exchange::ExpertStep experts = [&](const ReceivedRows& in, float* pair_out,
                                           float* row_out) {
    return ExpertStep(layer, split_shared, in, pair_out, row_out);
  };
  EPSERVE_ASSIGN_OR_RETURN(const ExpertPlacement* placement, PlacementFor(desc, layer));
  EPSERVE_RETURN_IF_ERROR(exchange_->UseLiveWorkers(desc.live, desc.generation));
  exchange_->CancelWhen(heap_.LocalAs<uint64_t>(regions_.cancel), desc.generation);
  EPSERVE_RETURN_IF_ERROR(exchange_->UsePlacement(*placement));
  ExchangeStats stats;
  if (on_device) {
    EPSERVE_RETURN_IF_ERROR(RunLocalOnDevice(layer, *placement, desc, y, stats));
  } else if (local) {
    EPSERVE_RETURN_IF_ERROR(RunLocal(layer, *placement, desc, y, stats));
  } else {
    DeviceExchange* mover = device_exchange_ != nullptr && device_exchange_->Serves(desc)
                                ? device_exchange_.get()
                                : nullptr;
    if (mover != nullptr) {
      device_exchange_->set_deliver([this, desc](const kernels::Buffer& out, float* rows) {
        return DeliverRows(desc, out, rows);
      });
    }
    EPSERVE_RETURN_IF_ERROR(exchange_->Run(x_in, n, ids_host_.data(), weights_host_.data(), y,
                                           owner_shared, experts, deadline, &stats, shared, mover));
    if (mover == nullptr && n > 0) EPSERVE_RETURN_IF_ERROR(DeliverHostRows(desc, y));
  }
  if (y == y_host_.data() && n > 0) {
    EPSERVE_RETURN_IF_ERROR(
        heap_.Put(0, regions_.Output(desc.slot) + static_cast<size_t>(desc.row_start) * row_bytes,
                  y, n * row_bytes));
  }
  if (!client_rows_error_.ok()) return std::exchange(client_rows_error_, absl::OkStatus());
  EPSERVE_RETURN_IF_ERROR(PublishExpertLoad(*placement, stats));
  ReportStats(stats, report);
  return absl::OkStatus();
}

}  // namespace epserve::worker
