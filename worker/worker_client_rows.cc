// A worker's rows in clients' memory, CUDA (worker/cuda_rows.h) and system shared memory
// (worker/host_rows.h): read into its input rows after the rows rank 0 copied, and its output
// rows written into them instead of rank 0's segment. The serve loop is in worker.cc.
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/worker.h"

namespace epserve::worker {

absl::Status Worker::StartCudaRows() {
  if (!rt_->device_info().is_gpu) {
    cuda_rows_why_ = "its device is not a GPU";
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<CudaRows>> rows =
      CudaRows::Create(*rt_, regions_.plan.max_rows_per_worker(), cfg_.hidden_size);
  if (!rows.ok()) {
    cuda_rows_why_ = std::string(rows.status().message());
    common::LogInfo(
        absl::StrCat("worker ", me_, ": no rows from CUDA shared memory (", cuda_rows_why_, ")"));
    return absl::OkStatus();
  }
  cuda_rows_ = *std::move(rows);
  return absl::OkStatus();
}

absl::Status Worker::StartHostRows() {
  const bool wanted = options_.reads_shm == AutoSwitch::kOn ||
                      (options_.reads_shm == AutoSwitch::kAuto && !rt_->device_info().is_cpu);
  // rank 0's descriptors name objects on this host: only where every rank is on it.
  if (!wanted || heap_.backend() != shmem::HeapBackend::kShm) return absl::OkStatus();
  EPSERVE_ASSIGN_OR_RETURN(host_rows_, HostRows::Create(*rt_, regions_.plan.max_rows_per_worker(),
                                                        cfg_.hidden_size, host_threads_));
  return absl::OkStatus();
}

absl::StatusOr<const DeviceRowTable*> Worker::DeviceRowsOf(const BatchDescriptor& desc) const {
  const auto* table = heap_.LocalAs<DeviceRowTable>(regions_.DeviceRowTables(desc.slot));
  if (table->count == 0) return nullptr;
  if (table->count < 0 || table->count > 2 * regions_.plan.max_rows_per_worker()) {
    return absl::InternalError(absl::StrCat("bad client row table: ", table->count, " segments"));
  }
  for (int64_t i = 0; i < table->count; ++i) {
    const bool host = table->segment(i).where.in_host_shm();
    if (!host && cuda_rows_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rows in CUDA shared memory, which this worker cannot reach: ", cuda_rows_why_));
    }
    if (host && host_rows_ == nullptr) {
      return absl::FailedPreconditionError(
          "rows in system shared memory, which this worker does not take (--workers-read-shm)");
    }
  }
  return table;
}

absl::Status Worker::ReadClientRows(const DeviceRowTable& table, int64_t n) {
  if (cuda_rows_ != nullptr) EPSERVE_RETURN_IF_ERROR(cuda_rows_->ReadInputs(table, n, x_local_));
  if (host_rows_ != nullptr) EPSERVE_RETURN_IF_ERROR(host_rows_->ReadInputs(table, n, x_local_));
  return absl::OkStatus();
}

absl::Status Worker::WriteClientRows(const DeviceRowTable& table, int64_t n,
                                     const kernels::Buffer& y) {
  if (cuda_rows_ != nullptr) EPSERVE_RETURN_IF_ERROR(cuda_rows_->WriteOutputs(table, n, y));
  if (host_rows_ != nullptr) EPSERVE_RETURN_IF_ERROR(host_rows_->WriteOutputs(table, n, y));
  return absl::OkStatus();
}

std::vector<std::pair<int64_t, int64_t>> HostRowRanges(const DeviceRowTable* table, int64_t n,
                                                       bool output) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t row = 0;  // rank 0 writes each direction's segments in row order
  for (int64_t i = 0; table != nullptr && i < table->count; ++i) {
    const DeviceRowSegment& s = table->segment(i);
    if ((s.output != 0) != output || s.first_row < row) continue;
    if (s.first_row > row) ranges.emplace_back(row, s.first_row);
    row = s.first_row + s.rows;
  }
  if (n > row) ranges.emplace_back(row, n);
  return ranges;
}

absl::Status Worker::DeviceRowsIn(const BatchDescriptor& desc, float* x_in) {
  EPSERVE_ASSIGN_OR_RETURN(const DeviceRowTable* table, DeviceRowsOf(desc));
  if (table == nullptr) return absl::OkStatus();
  const int64_t n = desc.num_rows;
  // A client's memory that cannot be read (freed, a bad span) fails the batch once it has run,
  // not here: the peers would wait for this worker in the exchange.
  if (absl::Status s = ReadClientRows(*table, n); !s.ok()) {
    client_rows_error_.Update(s);
    return absl::OkStatus();
  }
  const bool on_device =
      RunsLocally(desc) || (device_exchange_ != nullptr && device_exchange_->Serves(desc));
  if (on_device) return absl::OkStatus();
  // The exchange through the heap sends rows from the input slot: the segments' rows there too.
  const int64_t hidden = cfg_.hidden_size;
  for (int64_t i = 0; i < table->count; ++i) {
    const DeviceRowSegment& s = table->segment(i);
    if (s.output != 0) continue;
    EPSERVE_RETURN_IF_ERROR(rt_->Read(x_local_, s.first_row * hidden * sizeof(float),
                                      x_in + s.first_row * hidden,
                                      static_cast<size_t>(s.rows * hidden) * sizeof(float)));
  }
  return absl::OkStatus();
}

absl::Status Worker::DeliverRows(const BatchDescriptor& desc, const kernels::Buffer& out,
                                 float* y) {
  const int64_t n = desc.num_rows;
  const size_t row_bytes = static_cast<size_t>(cfg_.hidden_size) * sizeof(float);
  EPSERVE_ASSIGN_OR_RETURN(const DeviceRowTable* table, DeviceRowsOf(desc));
  if (table == nullptr) return rt_->Read(out, 0, y, static_cast<size_t>(n) * row_bytes);
  // The rows rank 0 answers from, then the segments' rows into the clients' memory.
  for (const auto& [begin, end] : HostRowRanges(table, n, /*output=*/true)) {
    EPSERVE_RETURN_IF_ERROR(rt_->Read(out, begin * row_bytes, y + begin * cfg_.hidden_size,
                                      static_cast<size_t>(end - begin) * row_bytes));
  }
  client_rows_error_.Update(WriteClientRows(*table, n, out));  // as in DeviceRowsIn
  return absl::OkStatus();
}

absl::Status Worker::DeliverHostRows(const BatchDescriptor& desc, const float* y) {
  EPSERVE_ASSIGN_OR_RETURN(const DeviceRowTable* table, DeviceRowsOf(desc));
  if (table == nullptr) return absl::OkStatus();
  // The exchange through the heap summed the rows on the host: up to the device for the
  // clients' memory (x_local_ is free once the batch has run).
  const size_t bytes = static_cast<size_t>(desc.num_rows * cfg_.hidden_size) * sizeof(float);
  EPSERVE_RETURN_IF_ERROR(rt_->Write(x_local_, 0, y, bytes));
  client_rows_error_.Update(WriteClientRows(*table, desc.num_rows, x_local_));
  return absl::OkStatus();
}

}  // namespace epserve::worker
