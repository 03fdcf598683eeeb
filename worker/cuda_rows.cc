#include "worker/cuda_rows.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/client_segments.h"

namespace epserve::worker {

absl::StatusOr<std::unique_ptr<CudaRows>> CudaRows::Create(kernels::Runtime& rt, int64_t max_rows,
                                                           int64_t hidden) {
  const kernels::DeviceInfo& info = rt.device_info();
  if (!shmem::CudaDevice::Built()) {
    return absl::UnimplementedError("this build has no CUDA driver API (no cuda.h at build time)");
  }
  if (!info.is_gpu || info.uuid.empty() || !info.imports_opaque_fd) {
    return absl::FailedPreconditionError(
        absl::StrCat(info.device_name,
                     " is not a GPU whose UUID and imported memory (cl_khr_device_uuid, "
                     "cl_khr_external_memory_opaque_fd) let CUDA memory reach its kernels"));
  }
  std::unique_ptr<CudaRows> rows(new CudaRows(rt, hidden));
  EPSERVE_ASSIGN_OR_RETURN(rows->cuda_, shmem::CudaDevice::ByUuid(info.uuid));
  size_t bytes = static_cast<size_t>(std::max<int64_t>(max_rows, 1) * hidden) * sizeof(float);
  EPSERVE_ASSIGN_OR_RETURN(
      const int fd, rows->cuda_->MakeExportable(&bytes, /*map=*/true, &rows->staging_address_));
  EPSERVE_ASSIGN_OR_RETURN(rows->staging_, rt.ImportOpaqueFd(fd, bytes));
  return rows;
}

CudaRows::~CudaRows() {
  for (const auto& [handle, opened] : open_) cuda_->CloseIpc(opened.address);
}

absl::StatusOr<uint64_t> CudaRows::Address(const DeviceRows& where, size_t bytes) {
  const std::string key(where.handle, sizeof(where.handle));
  auto it = open_.find(key);
  if (it == open_.end()) {
    if (open_.size() >= kMaxOpen) {
      auto oldest = std::min_element(open_.begin(), open_.end(), [](const auto& a, const auto& b) {
        return a.second.last_use < b.second.last_use;
      });
      cuda_->CloseIpc(oldest->second.address);
      open_.erase(oldest);
    }
    absl::StatusOr<shmem::CudaDevice::IpcMapping> m = cuda_->OpenIpc(key);
    if (!m.ok() && CloseUnused() > 0) {
      // A client that freed an allocation this worker still had open, and made a new one in
      // its place: the driver refuses the new handle (already mapped) until the old one is
      // closed. Nothing this batch uses was closed.
      m = cuda_->OpenIpc(key);
    }
    if (!m.ok()) return m.status();
    it = open_.emplace(key, Opened{m->address, m->bytes, 0}).first;
  }
  it->second.last_use = ++uses_;
  if (where.offset > it->second.bytes || bytes > it->second.bytes - where.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA shared memory region ", where.region_id, ": bytes [", where.offset, ", ",
                     where.offset + bytes, ") lie past the end of the client's allocation (",
                     it->second.bytes, " bytes)"));
  }
  return it->second.address + where.offset;
}

size_t CudaRows::CloseUnused() {
  size_t closed = 0;
  for (auto it = open_.begin(); it != open_.end();) {
    if (it->second.last_use >= first_use_of_step_) {
      ++it;
      continue;
    }
    cuda_->CloseIpc(it->second.address);
    it = open_.erase(it);
    ++closed;
  }
  return closed;
}

absl::Status CudaRows::ReadInputs(const DeviceRowTable& table, int64_t n, kernels::Buffer& x) {
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  first_use_of_step_ = uses_ + 1;
  bool first = true;
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output != 0 || s.where.in_host_shm()) continue;
    // The staging buffer is free once the device has done what was queued before.
    if (std::exchange(first, false)) EPSERVE_RETURN_IF_ERROR(rt_.Finish());
    EPSERVE_ASSIGN_OR_RETURN(const size_t bytes, SegmentBytes(s, n, hidden_, "CUDA"));
    EPSERVE_ASSIGN_OR_RETURN(const uint64_t from, Address(s.where, bytes));
    // Each segment at its own rows of the staging buffer (its bytes fit in their FP32 size).
    EPSERVE_RETURN_IF_ERROR(cuda_->Copy(staging_address_ + s.first_row * row_bytes, from, bytes));
  }
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output != 0 || s.where.in_host_shm()) continue;
    EPSERVE_RETURN_IF_ERROR(WidenSegment(rt_, staging_, s, hidden_, x));
  }
  return absl::OkStatus();
}

absl::Status CudaRows::WriteOutputs(const DeviceRowTable& table, int64_t n,
                                    const kernels::Buffer& y) {
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  first_use_of_step_ = uses_ + 1;
  bool any = false;
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output == 0 || s.where.in_host_shm()) continue;
    EPSERVE_RETURN_IF_ERROR(SegmentBytes(s, n, hidden_, "CUDA").status());
    EPSERVE_RETURN_IF_ERROR(NarrowSegment(rt_, y, s, hidden_, staging_));
    any = true;
  }
  if (!any) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(rt_.Finish());
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output == 0 || s.where.in_host_shm()) continue;
    EPSERVE_ASSIGN_OR_RETURN(const size_t bytes, SegmentBytes(s, n, hidden_, "CUDA"));
    EPSERVE_ASSIGN_OR_RETURN(const uint64_t to, Address(s.where, bytes));
    EPSERVE_RETURN_IF_ERROR(cuda_->Copy(to, staging_address_ + s.first_row * row_bytes, bytes));
  }
  return absl::OkStatus();
}

}  // namespace epserve::worker
