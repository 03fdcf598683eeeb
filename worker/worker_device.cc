// A worker's device path: rows moved device to device between the workers
// (worker/device_exchange.h, Worker::StartDeviceExchange) and rows uploaded ahead of their
// batch through the runtime's second queue (Worker::UploadLoop, RowsOnDevice). The serve loop
// is in worker.cc, the local run in worker_local.cc, the weights in worker_weights.cc.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/worker.h"

namespace epserve::worker {

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
  // Only the rows rank 0 copied: those in clients' memory come from there (DeviceRowsIn).
  EPSERVE_ASSIGN_OR_RETURN(const DeviceRowTable* table, DeviceRowsOf(desc));
  for (const auto& [begin, end] : HostRowRanges(table, desc.num_rows, /*output=*/false)) {
    EPSERVE_RETURN_IF_ERROR(rt_->Write(x_local_, begin * row_bytes, x_in + begin * cfg_.hidden_size,
                                       static_cast<size_t>(end - begin) * row_bytes));
  }
  return absl::OkStatus();
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

}  // namespace epserve::worker
