#include "worker/cuda_rows.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/moe_kernels.h"

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

absl::StatusOr<size_t> CudaRows::SegmentBytes(const DeviceRowSegment& s, int64_t n) const {
  if (s.first_row < 0 || s.rows < 1 || s.first_row + s.rows > n) {
    return absl::InternalError(absl::StrCat("a CUDA row segment of rows [", s.first_row, ", ",
                                            s.first_row + s.rows, ") outside the batch's ", n,
                                            " rows"));
  }
  const size_t element = common::ElementBytes(s.where.type);
  if (element == 0 || element > sizeof(float)) {
    return absl::InternalError("a CUDA row segment of an unknown element type");
  }
  return static_cast<size_t>(s.rows * hidden_) * element;
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
  // The staging buffer is free once the device has done what was queued before.
  EPSERVE_RETURN_IF_ERROR(rt_.Finish());
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output != 0) continue;
    EPSERVE_ASSIGN_OR_RETURN(const size_t bytes, SegmentBytes(s, n));
    EPSERVE_ASSIGN_OR_RETURN(const uint64_t from, Address(s.where, bytes));
    // Each segment at its own rows of the staging buffer (its bytes fit in their FP32 size).
    EPSERVE_RETURN_IF_ERROR(cuda_->Copy(staging_address_ + s.first_row * row_bytes, from, bytes));
  }
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output != 0) continue;
    const int64_t per_float =
        static_cast<int64_t>(sizeof(float) / common::ElementBytes(s.where.type));
    EPSERVE_RETURN_IF_ERROR(kernels::WidenToFp32(rt_, staging_, s.first_row * hidden_ * per_float,
                                                 s.where.type, s.rows * hidden_, x,
                                                 s.first_row * hidden_));
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
    if (s.output == 0) continue;
    EPSERVE_RETURN_IF_ERROR(SegmentBytes(s, n).status());
    const int64_t per_float =
        static_cast<int64_t>(sizeof(float) / common::ElementBytes(s.where.type));
    EPSERVE_RETURN_IF_ERROR(kernels::NarrowFromFp32(rt_, y, s.first_row * hidden_, s.rows * hidden_,
                                                    s.where.type, staging_,
                                                    s.first_row * hidden_ * per_float));
    any = true;
  }
  if (!any) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(rt_.Finish());
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output == 0) continue;
    EPSERVE_ASSIGN_OR_RETURN(const size_t bytes, SegmentBytes(s, n));
    EPSERVE_ASSIGN_OR_RETURN(const uint64_t to, Address(s.where, bytes));
    EPSERVE_RETURN_IF_ERROR(cuda_->Copy(to, staging_address_ + s.first_row * row_bytes, bytes));
  }
  return absl::OkStatus();
}

}  // namespace epserve::worker
