// The Runtime's transfers between host and device: Write and Read on the main queue,
// WriteBeside on a second queue (rows uploaded ahead), and large blocks through two pinned
// staging buffers, a chunk's host copy overlapping the other's DMA. Context, buffers and
// programs are in runtime.cc.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/parallel.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/runtime.h"

namespace epserve::kernels {

absl::Status Runtime::Write(const Buffer& dst, size_t offset, const void* src, size_t bytes) {
  return WriteOn(queue_, staging_, dst, offset, src, bytes);
}

absl::Status Runtime::WriteBeside(const Buffer& dst, size_t offset, const void* src, size_t bytes) {
  if (side_queue_ == nullptr) {
    cl_int err = CL_SUCCESS;
    CL_CHECK((side_queue_ = clCreateCommandQueue(context_, device_, 0, &err), err));
    // Staging buffers of its own: the main queue's may be in use by the thread driving it.
    if (stages_transfers()) {
      if (absl::Status s = MakeStaging(side_queue_, side_staging_); !s.ok()) {
        ReleaseStaging(side_queue_, side_staging_);
      }
    }
  }
  return WriteOn(side_queue_, side_staging_, dst, offset, src, bytes);
}

absl::Status Runtime::WriteOn(cl_command_queue queue, Staging (&pair)[2], const Buffer& dst,
                              size_t offset, const void* src, size_t bytes) {
  if (offset > dst.bytes() || bytes > dst.bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat("write of ", bytes, " bytes at offset ", offset,
                                              " exceeds the buffer's ", dst.bytes(), " bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  if (pair[0].host != nullptr && bytes >= kStagedTransferMin) {
    return StagedWrite(queue, pair, dst, offset, src, bytes);
  }
  cl_event event = nullptr;
  const bool record = profiles_commands() && queue == queue_;
  CL_CHECK(clEnqueueWriteBuffer(queue, dst.mem(), CL_TRUE, offset, bytes, src, 0, nullptr,
                                record ? &event : nullptr));
  if (event != nullptr) RecordCommand(event, nullptr, "write");
  return absl::OkStatus();
}

absl::Status Runtime::WriteAsync(const Buffer& dst, size_t offset, const void* src, size_t bytes) {
  return QueuePinned(dst, offset, const_cast<void*>(src), bytes, /*write=*/true);
}

absl::Status Runtime::ReadAsync(const Buffer& src, size_t offset, void* dst, size_t bytes) {
  return QueuePinned(src, offset, dst, bytes, /*write=*/false);
}

absl::Status Runtime::QueuePinned(const Buffer& buffer, size_t offset, void* host, size_t bytes,
                                  bool write) {
  const char* verb = write ? "write" : "read";
  if (offset > buffer.bytes() || bytes > buffer.bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat(verb, " of ", bytes, " bytes at offset ", offset,
                                              " exceeds the buffer's ", buffer.bytes(), " bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  const char* at = static_cast<const char*>(host);
  for (const Pinned& p : pinned_) {
    const char* base = static_cast<const char*>(p.memory.host);
    if (at < base || at > base + p.bytes || bytes > p.bytes - (at - base)) continue;
    cl_event event = nullptr;
    cl_event* record = profiles_commands() ? &event : nullptr;
    if (write) {
      CL_CHECK(clEnqueueWriteBuffer(queue_, buffer.mem(), CL_FALSE, offset, bytes, host, 0, nullptr,
                                    record));
    } else {
      CL_CHECK(clEnqueueReadBuffer(queue_, buffer.mem(), CL_FALSE, offset, bytes, host, 0, nullptr,
                                   record));
    }
    if (event != nullptr) RecordCommand(event, nullptr, verb);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(write ? "WriteAsync" : "ReadAsync", " of ", bytes,
                                                 " bytes with memory that AllocatePinnedHost did "
                                                 "not give"));
}

absl::StatusOr<void*> Runtime::AllocatePinnedHost(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("AllocatePinnedHost of 0 bytes");
  Pinned p;
  p.bytes = bytes;
  EPSERVE_RETURN_IF_ERROR(MapPinned(queue_, bytes, p.memory));
  pinned_.push_back(p);
  return p.memory.host;
}

absl::Status Runtime::Read(const Buffer& src, size_t offset, void* dst, size_t bytes) {
  if (offset > src.bytes() || bytes > src.bytes() - offset) {
    return absl::OutOfRangeError(absl::StrCat("read of ", bytes, " bytes at offset ", offset,
                                              " exceeds the buffer's ", src.bytes(), " bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  if (stages_transfers() && bytes >= kStagedTransferMin) {
    return StagedRead(src, offset, dst, bytes);
  }
  cl_event event = nullptr;
  CL_CHECK(clEnqueueReadBuffer(queue_, src.mem(), CL_TRUE, offset, bytes, dst, 0, nullptr,
                               profiles_commands() ? &event : nullptr));
  if (event != nullptr) RecordCommand(event, nullptr, "read");
  return absl::OkStatus();
}

absl::Status Runtime::MakeStaging() { return MakeStaging(queue_, staging_); }

absl::Status Runtime::MapPinned(cl_command_queue queue, size_t bytes, Staging& s) {
  cl_int err = CL_SUCCESS;
  CL_CHECK((s.mem = clCreateBuffer(context_, CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR, bytes,
                                   nullptr, &err),
            err));
  void* host = clEnqueueMapBuffer(queue, s.mem, CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0, bytes, 0,
                                  nullptr, nullptr, &err);
  if (err != CL_SUCCESS) ReleaseOne(queue, s);
  CL_CHECK(err);
  s.host = host;
  return absl::OkStatus();
}

absl::Status Runtime::MakeStaging(cl_command_queue queue, Staging (&pair)[2]) {
  for (Staging& s : pair) EPSERVE_RETURN_IF_ERROR(MapPinned(queue, kStagingChunk, s));
  return absl::OkStatus();
}

void Runtime::ReleaseStaging() { ReleaseStaging(queue_, staging_); }

void Runtime::ReleaseOne(cl_command_queue queue, Staging& s) {
  if (s.busy != nullptr) {
    clWaitForEvents(1, &s.busy);
    clReleaseEvent(s.busy);
  }
  if (s.host != nullptr) {
    clEnqueueUnmapMemObject(queue, s.mem, s.host, 0, nullptr, nullptr);
    clFinish(queue);
  }
  if (s.mem != nullptr) clReleaseMemObject(s.mem);
  s = Staging{};
}

void Runtime::ReleaseStaging(cl_command_queue queue, Staging (&pair)[2]) {
  for (Staging& s : pair) ReleaseOne(queue, s);
}

absl::Status Runtime::WaitStaging(Staging& s) {
  if (s.busy == nullptr) return absl::OkStatus();
  const cl_int err = clWaitForEvents(1, &s.busy);
  clReleaseEvent(s.busy);
  s.busy = nullptr;
  CL_CHECK(err);
  return absl::OkStatus();
}

// Chunk i: wait until staging buffer i % 2 has been sent (chunk i - 2), copy the chunk into
// it, enqueue its DMA; the next chunk's copy then runs while this DMA does.
absl::Status Runtime::StagedWrite(cl_command_queue queue, Staging (&pair)[2], const Buffer& dst,
                                  size_t offset, const void* src, size_t bytes) {
  const char* from = static_cast<const char*>(src);
  absl::Status status;
  for (size_t done = 0, i = 0; done < bytes && status.ok(); ++i) {
    Staging& s = pair[i % 2];
    status = WaitStaging(s);
    if (!status.ok()) break;
    const size_t len = std::min(kStagingChunk, bytes - done);
    const common::CopyJob job{s.host, from + done, len};
    common::ParallelCopy(transfer_threads_, {&job, 1});
    const cl_int err = clEnqueueWriteBuffer(queue, dst.mem(), CL_FALSE, offset + done, len, s.host,
                                            0, nullptr, &s.busy);
    if (err != CL_SUCCESS) {
      s.busy = nullptr;
      status = detail::ClError(err, "clEnqueueWriteBuffer (staged)", __FILE__, __LINE__);
    }
    clFlush(queue);
    done += len;
  }
  for (Staging& s : pair) {
    const absl::Status w = WaitStaging(s);
    if (status.ok()) status = w;
  }
  return status;
}

// Two chunks' DMA in flight; chunk i is copied out of its staging buffer once its DMA ended,
// then that buffer takes chunk i + 2.
absl::Status Runtime::StagedRead(const Buffer& src, size_t offset, void* dst, size_t bytes) {
  char* to = static_cast<char*>(dst);
  const size_t chunks = (bytes + kStagingChunk - 1) / kStagingChunk;
  auto chunk_len = [&](size_t i) { return std::min(kStagingChunk, bytes - i * kStagingChunk); };
  auto enqueue = [&](size_t i) -> absl::Status {
    Staging& s = staging_[i % 2];
    const cl_int err = clEnqueueReadBuffer(queue_, src.mem(), CL_FALSE, offset + i * kStagingChunk,
                                           chunk_len(i), s.host, 0, nullptr, &s.busy);
    if (err != CL_SUCCESS) {
      s.busy = nullptr;
      return detail::ClError(err, "clEnqueueReadBuffer (staged)", __FILE__, __LINE__);
    }
    clFlush(queue_);
    return absl::OkStatus();
  };
  absl::Status status;
  for (size_t i = 0; i < std::min<size_t>(chunks, 2) && status.ok(); ++i) status = enqueue(i);
  for (size_t i = 0; i < chunks && status.ok(); ++i) {
    Staging& s = staging_[i % 2];
    status = WaitStaging(s);
    if (!status.ok()) break;
    const common::CopyJob job{to + i * kStagingChunk, s.host, chunk_len(i)};
    common::ParallelCopy(transfer_threads_, {&job, 1});
    if (i + 2 < chunks) status = enqueue(i + 2);
  }
  for (Staging& s : staging_) {
    const absl::Status w = WaitStaging(s);
    if (status.ok()) status = w;
  }
  return status;
}

}  // namespace epserve::kernels
