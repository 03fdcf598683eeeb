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

namespace epserve::worker {
namespace {

int64_t NanosSince(absl::Time start) { return absl::ToInt64Nanoseconds(absl::Now() - start); }

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(shmem::SymmetricHeap& heap,
                                                       const HeapRegions& regions,
                                                       const model::WeightSource& source,
                                                       const WorkerOptions& options) {
  std::unique_ptr<Worker> w(new Worker(heap, regions, source.config(), options));
  w->rank_ = heap.rank();
  w->me_ = WorkerOfRank(heap.rank());
  w->live_ = WorkerSet::All(regions.plan.shape().num_workers);
  w->orphan_grace_ = options.orphan_grace;
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

absl::StatusOr<std::vector<Worker::Layer>> Worker::LoadLayers(
    const model::WeightSource& source, const std::vector<ExpertPlacement>& placements,
    const std::vector<Layer>* reuse) {
  std::vector<Layer> layers;
  for (size_t pos = 0; pos < source.config().moe_layers.size(); ++pos) {
    const int layer = source.config().moe_layers[pos];
    Layer l;
    l.placement = &placements[pos];
    EPSERVE_ASSIGN_OR_RETURN(l.router, kernels::UploadRouter(*rt_, source, layer));
    const kernels::ExpertWeights* have =
        reuse != nullptr && pos < reuse->size() ? &(*reuse)[pos].experts : nullptr;
    EPSERVE_ASSIGN_OR_RETURN(l.experts,
                             kernels::UploadExperts(*rt_, source, layer, l.placement->experts(me_),
                                                    options_.weight_dtype, have));
    if (cfg_.shared_ffn_size > 0) {
      // Split: this worker's slice of the shared expert's intermediate columns.
      std::unique_ptr<model::WeightSource> slice;
      if (regions_.plan.shared_expert_split()) {
        EPSERVE_ASSIGN_OR_RETURN(
            slice, model::SharedExpertSlice(source, me_, regions_.plan.shape().num_workers));
      }
      EPSERVE_ASSIGN_OR_RETURN(
          l.shared, kernels::UploadSharedExpert(*rt_, slice != nullptr ? *slice : source, layer,
                                                options_.weight_dtype));
    }
    layers.push_back(std::move(l));
  }
  return layers;
}

absl::Status Worker::CheckRoomForSecondCopy() const {
  if (!rt_->device_info().is_cpu) return absl::OkStatus();  // device memory: the upload says
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = -1;
  while (meminfo >> key) {
    if (key == "MemAvailable:") {
      meminfo >> kib;
      break;
    }
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  if (kib < 0) return absl::OkStatus();  // not Linux: the upload says
  const int64_t need = static_cast<int64_t>(weight_bytes());
  const int64_t have = kib * 1024;
  // Every worker of the host stages at the same time, each about as much as this one: all
  // their second copies must fit, with a quarter to spare.
  const int64_t all = need * std::max(options_.workers_on_host, 1);
  if (all * 5 / 4 > have) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a second copy of the weights of this host's ", options_.workers_on_host, " worker(s) (",
        all, " bytes, +25%) does not fit in the host's available memory (", have,
        " bytes); the served weights stay"));
  }
  return absl::OkStatus();
}

Worker::~Worker() {
  if (loader_.joinable()) loader_.join();
  device_exchange_.reset();  // its buffers before the runtime they were made on
}

absl::Status Worker::Stage(uint64_t seq) {
  EPSERVE_RETURN_IF_ERROR(EndStage(false));  // a swap rank 0 gave up on
  if (!options_.open_model) {
    return absl::UnimplementedError("this worker was started without a model loader");
  }
  const ControlMessage& msg = *heap_.LocalAs<ControlMessage>(regions_.control);
  const std::string spec(msg.model, std::min<size_t>(msg.model_bytes, ControlMessage::kMaxModel));
  const uint64_t seed = msg.seed;
  // New placements (a rebalance) come in the input region, free between batches; else the
  // serving ones stay.
  staged_placements_ = placements_;
  const bool rebalance = msg.placement_words > 0;
  if (rebalance) {
    const size_t words = msg.placement_words;
    if (words * sizeof(int32_t) > regions_.InputBytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a placement table of ", words, " words does not fit the input region"));
    }
    absl::StatusOr<std::vector<ExpertPlacement>> placements =
        DecodePlacements(std::span<const int32_t>(heap_.LocalAs<int32_t>(regions_.input), words),
                         cfg_.num_experts, regions_.plan.shape().num_workers);
    if (!placements.ok()) return placements.status();
    EPSERVE_RETURN_IF_ERROR(CheckPlacements(*placements));
    staged_placements_ = *std::move(placements);
  }
  absl::StatusOr<std::unique_ptr<model::WeightSource>> source = options_.open_model(spec, seed);
  if (!source.ok()) return source.status();
  EPSERVE_RETURN_IF_ERROR(model::CheckSameShape(model_, (*source)->config()));
  EPSERVE_RETURN_IF_ERROR(CheckRoomForSecondCopy());
  stage_seq_ = seq;
  stage_published_ = false;
  load_done_.store(false);
  loader_ = std::thread([this, spec, seed, rebalance, src = *std::move(source)] {
    common::NameThisThread("ep-stage-weights");
    const absl::Time start = absl::Now();
    // A rebalance keeps the weights: the experts this worker holds are copied on its device,
    // only its new copies come from the source (the serving layers change only at kSwitch,
    // after this thread has ended).
    absl::StatusOr<std::vector<Layer>> layers =
        LoadLayers(*src, staged_placements_, rebalance ? &layers_ : nullptr);
    if (layers.ok()) {
      staged_ = *std::move(layers);
      staged_model_ = src->config();
      common::LogInfo(absl::StrCat(
          "worker ", me_, ": loaded the weights of ", spec.substr(0, 128), " (seed ", seed, ") in ",
          absl::FormatDuration(absl::Now() - start), " beside the serving ones"));
    } else {
      load_status_ = absl::Status(
          layers.status().code(),
          absl::StrCat("loading ", spec.substr(0, 128), ": ", layers.status().message()));
    }
    load_done_.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

absl::Status Worker::PublishStage() {
  if (stage_seq_ == 0 || stage_published_ || !load_done_.load(std::memory_order_acquire)) {
    return absl::OkStatus();
  }
  WorkerReport report;
  std::memset(&report, 0, sizeof(report));
  if (!load_status_.ok()) {
    report.status_code = static_cast<int32_t>(load_status_.code());
    const std::string msg =
        absl::StrCat("worker ", me_, " (rank ", rank_, "): ", load_status_.message());
    std::strncpy(report.message, msg.c_str(), sizeof(report.message) - 1);
  } else {
    for (const Layer& l : staged_) {
      report.weight_bytes += static_cast<int64_t>(
          l.router.router.bytes() + l.router.bias.bytes() + l.experts.bytes_from_source +
          l.shared.bytes_from_source + l.shared.gate.bytes());
    }
  }
  EPSERVE_RETURN_IF_ERROR(
      heap_.Put(0, regions_.stage_reports + static_cast<size_t>(me_) * sizeof(WorkerReport),
                &report, sizeof(report)));
  EPSERVE_RETURN_IF_ERROR(
      heap_.SignalSet(0, HeapRegions::Signal(regions_.staged, me_), stage_seq_));
  stage_published_ = true;
  return absl::OkStatus();
}

absl::Status Worker::EndStage(bool use_new) {
  if (use_new && (stage_seq_ == 0 || !load_done_.load(std::memory_order_acquire))) {
    return absl::FailedPreconditionError("kSwitch before the new weights were loaded");
  }
  if (loader_.joinable()) loader_.join();
  absl::Status status = load_status_;
  if (use_new && status.ok()) {
    // Each layer points at its placement: both move together.
    layers_.swap(staged_);
    placements_.swap(staged_placements_);
    survivor_placements_.clear();
    model_ = staged_model_;
    common::LogInfo(
        absl::StrCat("worker ", me_, ": serving the weights of ", model_.source.substr(0, 128)));
  }
  staged_.clear();  // the old weights' device buffers, or the unused new ones
  staged_placements_.clear();
  stage_seq_ = 0;
  stage_published_ = false;
  load_status_ = absl::OkStatus();
  malloc_trim(0);
  return use_new ? status : absl::OkStatus();
}

absl::Status Worker::WarmUp() {
  const int64_t hidden = cfg_.hidden_size;
  const std::vector<float> zeros(static_cast<size_t>(hidden), 0.0f);
  // The FFN runs on 1 row of the first expert, then, where its kernels change with the rows,
  // on as many as take the other form, if the buffers hold them; every row reads row 0 of x.
  const int64_t capacity = static_cast<int64_t>(row_index_.bytes() / sizeof(int32_t));
  auto row_counts = [&](const Layer& layer) {
    std::vector<int64_t> counts = {1};
    const int64_t second = kernels::ExpertFfnSecondFormRows(layer.experts);
    if (second > 1 && second <= capacity) counts.push_back(second);
    return counts;
  };
  int64_t most_rows = 1;
  for (const Layer& layer : layers_) most_rows = std::max(most_rows, row_counts(layer).back());
  const std::vector<int32_t> row0(static_cast<size_t>(most_rows), 0);
  EPSERVE_RETURN_IF_ERROR(rt_->Write(x_local_, 0, zeros.data(), zeros.size() * sizeof(float)));
  EPSERVE_RETURN_IF_ERROR(rt_->Write(x_recv_, 0, zeros.data(), zeros.size() * sizeof(float)));
  EPSERVE_RETURN_IF_ERROR(rt_->Write(row_index_, 0, row0.data(), row0.size() * sizeof(int32_t)));
  // Rows reach the expert FFN as FP32, or as BF16 where they are dispatched so and the shared
  // expert's slice does not need them widened (RunBatch's expert step).
  const bool bf16_rows = regions_.plan.dispatch_dtype() == common::ElementType::kBf16;
  for (const Layer& layer : layers_) {
    EPSERVE_RETURN_IF_ERROR(kernels::Route(*rt_, layer.router, x_local_, 1, ids_, weights_));
    for (const int64_t rows : row_counts(layer)) {
      if (layer.experts.num_experts == 0) break;
      // All `rows` rows in the first expert.
      std::vector<int64_t> offsets(static_cast<size_t>(layer.experts.num_experts) + 1, rows);
      offsets[0] = 0;
      EPSERVE_RETURN_IF_ERROR(
          kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_, offsets, h_, y_));
      if (bf16_rows) {
        const kernels::RowFormat bf16 = {common::ElementType::kBf16, hidden};
        EPSERVE_RETURN_IF_ERROR(
            kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_, offsets, h_, y_, bf16));
      }
    }
    if (layer.shared.num_experts > 0) {
      EPSERVE_RETURN_IF_ERROR(
          kernels::SharedExpertFfn(*rt_, layer.shared, x_local_, 1, shared_h_, shared_y_));
    }
  }
  if (device_exchange_ != nullptr) EPSERVE_RETURN_IF_ERROR(device_exchange_->WarmUp());
  return rt_->Finish();
}

absl::Status Worker::StartDeviceExchange() {
  const ExchangePlan& plan = regions_.plan;
  const kernels::DeviceInfo& info = rt_->device_info();
  DeviceExchangeMode mode = options_.device_exchange;
  if (plan.shape().num_workers < 2 && mode != DeviceExchangeMode::kOff) {
    exchange_path_ = "one worker: nothing to exchange between devices";
    return absl::OkStatus();
  }
  if (mode == DeviceExchangeMode::kAuto) {
    // Every worker decides alike where the workers' devices are alike; one that differs
    // declines the rendezvous, and the others fall back with it.
    const bool can = info.is_gpu && info.imports_opaque_fd && !info.uuid.empty() &&
                     shmem::PeerMemoryKindBuilt(shmem::PeerMemoryKind::kCuda) &&
                     heap_.backend() == shmem::HeapBackend::kShm;
    if (!can) {
      exchange_path_ = info.is_gpu ? "through the heap (the GPU path needs CUDA memory imported "
                                     "into OpenCL and the shm heap)"
                                   : "through the heap";
      return absl::OkStatus();
    }
    mode = DeviceExchangeMode::kCuda;
  }
  if (mode == DeviceExchangeMode::kOff) {
    exchange_path_ = "through the heap (--device-exchange=off)";
    return absl::OkStatus();
  }
  const shmem::PeerMemoryKind kind = mode == DeviceExchangeMode::kCuda
                                         ? shmem::PeerMemoryKind::kCuda
                                         : shmem::PeerMemoryKind::kHost;
  const int64_t row_parts =
      plan.shared_expert_split() ? plan.recv_capacity() : plan.max_rows_per_worker();
  absl::StatusOr<std::unique_ptr<DeviceExchange>> dx = DeviceExchange::Create(
      *rt_, heap_, regions_, me_, kind, row_parts, {&x_recv_, &y_, &shared_y_},
      {&x_local_, &weights_}, absl::Now() + options_.rendezvous_timeout);
  if (!dx.ok()) {
    if (options_.device_exchange != DeviceExchangeMode::kAuto) {
      return absl::Status(dx.status().code(),
                          absl::StrCat("--device-exchange=", DeviceExchangeModeName(mode), ": ",
                                       dx.status().message()));
    }
    exchange_path_ = absl::StrCat(
        "through the heap (device to device not available: ", dx.status().message(), ")");
    common::LogWarning(absl::StrCat("worker ", me_, ": rows go ", exchange_path_));
    return absl::OkStatus();
  }
  device_exchange_ = *std::move(dx);
  exchange_path_ = absl::StrCat("device to device (", shmem::PeerMemoryKindName(kind), ")");
  return absl::OkStatus();
}

std::string Worker::exchange_path() const { return exchange_path_; }

std::string Worker::ffn_blocking() const {
  std::vector<std::string> parts;
  for (const kernels::FfnChoice& c : rt_->ffn_choices()) parts.push_back(c.Describe());
  return parts.empty() ? std::string("none (no portable FFN kernels in use)")
                       : absl::StrJoin(parts, "; ");
}

const char* Worker::ffn_kernels() const {
  return layers_.empty() ? "none" : kernels::FfnKernelsName(*rt_, layers_.front().experts);
}

size_t Worker::LayerBytes(const Layer& l) {
  return l.router.router.bytes() + l.router.bias.bytes() + l.experts.bytes() + l.shared.bytes();
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
  upload_ahead_ =
      heap_.backend() == shmem::HeapBackend::kShm &&
      (options_.upload_ahead == WorkerOptions::UploadAhead::kOn ||
       (options_.upload_ahead == WorkerOptions::UploadAhead::kAuto && !rt_->device_info().is_cpu));
  if (upload_ahead_) {
    EPSERVE_ASSIGN_OR_RETURN(x_next_, rt_->Allocate(std::max<size_t>(n * h * f, 64)));
  }
  ids_host_.resize(n * k);
  weights_host_.resize(n * k);
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
  EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(0, HeapRegions::Signal(regions_.ready, me_), 1));
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
  idle.max_sleep = absl::Microseconds(200);
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
    if (desc.op != BatchOp::kStop) {
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
      if (!s.ok()) {
        report.status_code = static_cast<int32_t>(s.code());
        const std::string msg = absl::StrCat("worker ", me_, " (rank ", rank_, "): ", s.message());
        std::strncpy(report.message, msg.c_str(), sizeof(report.message) - 1);
        if (absl::IsDeadlineExceeded(s)) {
          common::LogError(absl::StrCat("batch ", seq, ": ", msg));
        }
      }
    }
    EPSERVE_RETURN_IF_ERROR(
        heap_.Put(0, regions_.reports + static_cast<size_t>(me_) * sizeof(WorkerReport), &report,
                  sizeof(report)));
    EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(0, HeapRegions::Signal(regions_.done_seq, me_), seq));
    EPSERVE_RETURN_IF_ERROR(PublishStage());
    if (desc.op == BatchOp::kStop) return absl::OkStatus();
  }
}

// The route stage (n > 0 rows): this worker's rows through the router; the routing goes to
// rank 0 too (outputs topk_ids, topk_weights).
absl::Status Worker::Route(const Layer& layer, const BatchDescriptor& desc, const float* x_in) {
  const int k = cfg_.top_k;
  const int64_t n = desc.num_rows;
  EPSERVE_RETURN_IF_ERROR(RowsOnDevice(desc, x_in));
  EPSERVE_RETURN_IF_ERROR(kernels::Route(*rt_, layer.router, x_local_, n, ids_, weights_));
  EPSERVE_RETURN_IF_ERROR(rt_->Read(ids_, 0, ids_host_.data(), n * k * sizeof(int32_t)));
  EPSERVE_RETURN_IF_ERROR(rt_->Read(weights_, 0, weights_host_.data(), n * k * sizeof(float)));
  // The done signal completes these Puts.
  const size_t routing_bytes = static_cast<size_t>(n * k) * sizeof(int32_t);
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

absl::Status Worker::RowsOnDevice(const BatchDescriptor& desc, const float* x_in) {
  bool have = false;
  {
    std::unique_lock<std::mutex> lock(ahead_mu_);
    if (desc.copy_id != 0) {
      last_started_copy_ = std::max(last_started_copy_, desc.copy_id);
      if (ahead_copy_ == desc.copy_id) {
        // An upload of these rows under way ends within a transfer's time.
        ahead_cv_.wait_until(lock, absl::ToChronoTime(absl::FromUnixMicros(desc.deadline_unix_us)),
                             [&] { return ahead_state_ != AheadState::kUploading; });
        have = ahead_state_ == AheadState::kReady && ahead_rows_ == desc.num_rows;
      }
    }
    if (have) {
      std::swap(x_local_, x_next_);
      ++batches_uploaded_ahead_;
    }
    // Used, or of a copy no batch will read: x_next_ is free for the next one.
    if (ahead_state_ == AheadState::kReady) ahead_state_ = AheadState::kIdle;
  }
  ahead_cv_.notify_all();
  if (have) return absl::OkStatus();
  const size_t row_bytes = static_cast<size_t>(cfg_.hidden_size) * sizeof(float);
  return rt_->Write(x_local_, 0, x_in, static_cast<size_t>(desc.num_rows) * row_bytes);
}

void Worker::UploadLoop(const std::atomic<bool>& stop) {
  uint64_t* signal = heap_.LocalAs<uint64_t>(regions_.rows_ahead_seq);
  const size_t row_bytes = static_cast<size_t>(cfg_.hidden_size) * sizeof(float);
  uint64_t seen = 0;
  shmem::WaitOptions wait;
  wait.max_sleep = absl::Microseconds(50);
  wait.cancel = &stop;
  while (!stop.load()) {
    if (!shmem::WaitAtLeast(signal, seen + 1, absl::Now() + absl::Milliseconds(200),
                            "rows announced", wait)
             .ok()) {
      continue;  // none within 200 ms, or stopping
    }
    seen = shmem::SignalLoad(signal);
    const RowsAhead ahead = heap_.LocalAs<RowsAhead>(regions_.rows_ahead)[seen % 2];
    {
      std::unique_lock<std::mutex> lock(ahead_mu_);
      // x_next_ free first (the last upload used or dropped by the batch thread).
      while (ahead_state_ != AheadState::kIdle && !stop.load()) {
        ahead_cv_.wait_for(lock, std::chrono::milliseconds(50));
      }
      // Not a copy some batch began with already (then rank 0 may be rewriting the record or
      // the slot, and the batch has its rows anyway), and a whole, sane record.
      if (stop.load() || seen <= last_started_copy_ || ahead.copy_id != seen || ahead.slot < 0 ||
          ahead.slot >= HeapRegions::kSlots || ahead.num_rows <= 0 ||
          ahead.num_rows > regions_.plan.max_rows_per_worker()) {
        continue;
      }
      ahead_state_ = AheadState::kUploading;
      ahead_copy_ = seen;
      ahead_rows_ = ahead.num_rows;
    }
    const absl::Status s =
        rt_->WriteBeside(x_next_, 0, heap_.LocalAs<float>(regions_.Input(ahead.slot)),
                         static_cast<size_t>(ahead.num_rows) * row_bytes);
    if (!s.ok()) common::LogWarning(absl::StrCat("worker ", me_, ": upload ahead: ", s.message()));
    {
      std::lock_guard<std::mutex> lock(ahead_mu_);
      ahead_state_ = s.ok() ? AheadState::kReady : AheadState::kIdle;
    }
    ahead_cv_.notify_all();
  }
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
  const float* x_in = heap_.LocalAs<float>(regions_.Input(desc.slot));
  ++batches_served_;

  absl::Time t0 = absl::Now();
  if (n > 0) EPSERVE_RETURN_IF_ERROR(Route(layer, desc, x_in));
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
  if (RunsLocally(desc)) {
    EPSERVE_RETURN_IF_ERROR(RunLocal(layer, *placement, desc, y, stats));
  } else {
    DeviceExchange* mover = device_exchange_ != nullptr && device_exchange_->Serves(desc)
                                ? device_exchange_.get()
                                : nullptr;
    EPSERVE_RETURN_IF_ERROR(exchange_->Run(x_in, n, ids_host_.data(), weights_host_.data(), y,
                                           owner_shared, experts, deadline, &stats, shared, mover));
  }
  if (y == y_host_.data() && n > 0) {
    EPSERVE_RETURN_IF_ERROR(
        heap_.Put(0, regions_.Output(desc.slot) + static_cast<size_t>(desc.row_start) * row_bytes,
                  y, n * row_bytes));
  }
  EPSERVE_RETURN_IF_ERROR(PublishExpertLoad(*placement, stats));
  report.stage_ns[kLayout] = stats.layout_ns;
  report.stage_ns[kDispatch] = stats.dispatch_ns;
  report.stage_ns[kExpertFfn] = stats.expert_ns;
  report.stage_ns[kCombine] = stats.combine_ns;
  report.rows_received = stats.rows_received;
  report.pairs = stats.pairs;
  return absl::OkStatus();
}

bool Worker::RunsLocally(const BatchDescriptor& desc) const {
  const ExchangePlan& plan = regions_.plan;
  auto reproduced = [](common::ElementType t) {
    return t == common::ElementType::kFp32 || t == common::ElementType::kBf16;
  };
  return options_.local_pass && desc.live.Count() == 1 && desc.live.Has(me_) &&
         reproduced(plan.dispatch_dtype()) && reproduced(plan.combine_dtype()) &&
         desc.num_rows <= plan.recv_capacity();
}

absl::Status Worker::RunLocal(const Layer& layer, const ExpertPlacement& placement,
                              const BatchDescriptor& desc, float* y, ExchangeStats& stats) {
  const int64_t n = desc.num_rows;
  const int k = cfg_.top_k;
  const int64_t hidden = cfg_.hidden_size;
  const ExchangePlan& plan = regions_.plan;
  const int num_local = layer.experts.num_experts;
  stats.rounds = 1;
  stats.expert_pairs.assign(num_local, 0);
  if (n == 0) return absl::OkStatus();

  // ---- the pair table (the `layout` stage): expert-major, tokens in order within an expert ----
  absl::Time t0 = absl::Now();
  local_of_expert_.assign(cfg_.num_experts, -1);
  for (int e = 0; e < placement.count(me_); ++e) local_of_expert_[placement.expert(me_, e)] = e;
  const int64_t pairs = n * k;
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t id = ids_host_[i];
    const int local = id >= 0 && id < cfg_.num_experts ? local_of_expert_[id] : -1;
    if (local < 0 || local >= num_local) {
      return absl::InternalError(absl::StrCat("token ", i / k, " routed to expert ", id,
                                              ", which this worker does not hold"));
    }
    ++stats.expert_pairs[local];
  }
  local_offsets_.assign(num_local + 1, 0);
  for (int e = 0; e < num_local; ++e) {
    local_offsets_[e + 1] = local_offsets_[e] + stats.expert_pairs[e];
  }
  std::vector<int64_t> next(local_offsets_.begin(), local_offsets_.end() - 1);
  local_pair_row_.resize(pairs);
  local_pair_of_choice_.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t at = next[local_of_expert_[ids_host_[i]]]++;
    local_pair_row_[at] = static_cast<int32_t>(i / k);
    local_pair_of_choice_[i] = static_cast<int32_t>(at);
  }
  // ids_ (read to the host by Route) now holds each choice's pair.
  EPSERVE_RETURN_IF_ERROR(
      rt_->Write(row_index_, 0, local_pair_row_.data(), pairs * sizeof(int32_t)));
  EPSERVE_RETURN_IF_ERROR(
      rt_->Write(ids_, 0, local_pair_of_choice_.data(), pairs * sizeof(int32_t)));
  stats.layout_ns = NanosSince(t0);

  // ---- the rows as the dispatch payload would deliver them (the `dispatch` stage) ----
  t0 = absl::Now();
  const bool bf16_rows = plan.dispatch_dtype() == common::ElementType::kBf16;
  const kernels::Buffer& x = bf16_rows ? x_recv_ : x_local_;
  if (bf16_rows) EPSERVE_RETURN_IF_ERROR(kernels::RoundToBf16(*rt_, x_local_, n * hidden, x_recv_));
  stats.rows_received = n;
  stats.pairs = pairs;
  stats.dispatch_ns = NanosSince(t0);

  // ---- the experts and the shared expert ----
  t0 = absl::Now();
  EPSERVE_RETURN_IF_ERROR(
      kernels::ExpertFfn(*rt_, layer.experts, x, row_index_, local_offsets_, h_, y_));
  kernels::SumStart start = kernels::SumStart::kZero;
  if (layer.shared.num_experts > 0) {
    // The whole shared expert on the unrounded rows (the owner's own), or its one slice on the
    // rows as received (split), as the exchange runs them.
    const bool split = plan.shared_expert_split();
    EPSERVE_RETURN_IF_ERROR(kernels::SharedExpertFfn(*rt_, layer.shared, split ? x : x_local_, n,
                                                     shared_h_, shared_y_));
    start = split ? kernels::SumStart::kAsPart : kernels::SumStart::kOnto;
  }
  EPSERVE_RETURN_IF_ERROR(rt_->Finish());
  stats.expert_ns = NanosSince(t0);

  // ---- the owner's sum, on the device, and the output rows down once ----
  t0 = absl::Now();
  EPSERVE_RETURN_IF_ERROR(
      kernels::SumPairRows(*rt_, y_, ids_, weights_, n, k, hidden, &shared_y_, start,
                           plan.combine_dtype() == common::ElementType::kBf16, shared_y_));
  EPSERVE_RETURN_IF_ERROR(
      rt_->Read(shared_y_, 0, y, static_cast<size_t>(n * hidden) * sizeof(float)));
  stats.combine_ns = NanosSince(t0);
  return absl::OkStatus();
}

}  // namespace epserve::worker
