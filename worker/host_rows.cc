#include "worker/host_rows.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/parallel.h"
#include "common/status.h"
#include "worker/client_segments.h"

namespace epserve::worker {
namespace {

std::string RegionName(const DeviceRows& where) {
  return absl::StrCat("system shared memory region ", where.region_id);
}

// `bytes` bytes of the object at where.offset into `to`, zeros for those past its end (its
// owner shrank it: rank 0 answers the request with an error, SharedMemoryRegion::CheckIntact,
// and the batch's other requests go on).
absl::Status ReadFully(int fd, const DeviceRows& where, char* to, size_t bytes) {
  for (size_t done = 0; done < bytes;) {
    const ssize_t got = pread(fd, to + done, bytes - done, static_cast<off_t>(where.offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(RegionName(where), ": cannot read: ", std::strerror(errno)));
    }
    if (got == 0) {
      std::memset(to + done, 0, bytes - done);
      return absl::OkStatus();
    }
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

// `bytes` bytes from `from` into the object at where.offset; none where the object no longer
// holds them (shrunk by its owner: the request is answered with an error, as for a read).
absl::Status WriteFully(int fd, const DeviceRows& where, const char* from, size_t bytes) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(RegionName(where), ": cannot stat: ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < where.offset + bytes) return absl::OkStatus();
  for (size_t done = 0; done < bytes;) {
    const ssize_t put =
        pwrite(fd, from + done, bytes - done, static_cast<off_t>(where.offset + done));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(RegionName(where), ": cannot write: ", std::strerror(errno)));
    }
    done += static_cast<size_t>(put);
  }
  return absl::OkStatus();
}

// fn(offset, length) over [0, bytes) in ranges of at least kMinThreadBytes on up to `threads`
// threads (a prefill-sized batch's rows are tens of MB, which one thread reads from the page
// cache at a few GB/s); the first error.
constexpr int64_t kMinThreadBytes = int64_t{1} << 20;
absl::Status InParallel(int threads, size_t bytes,
                        const std::function<absl::Status(size_t, size_t)>& fn) {
  std::mutex mu;
  absl::Status first;
  common::ParallelFor(
      threads, static_cast<int64_t>(bytes), kMinThreadBytes, [&](int64_t begin, int64_t end) {
        absl::Status s = fn(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
        if (s.ok()) return;
        std::lock_guard<std::mutex> lock(mu);
        first.Update(s);
      });
  return first;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostRows>> HostRows::Create(kernels::Runtime& rt, int64_t max_rows,
                                                           int64_t hidden, int host_threads) {
  std::unique_ptr<HostRows> rows(new HostRows(rt, hidden, host_threads));
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(max_rows, 1) * hidden) * sizeof(float);
  EPSERVE_ASSIGN_OR_RETURN(rows->staging_, rt.Allocate(bytes));
  EPSERVE_ASSIGN_OR_RETURN(void* pinned, rt.AllocatePinnedHost(bytes));
  rows->pinned_ = static_cast<char*>(pinned);
  return rows;
}

HostRows::~HostRows() {
  for (const auto& [id, opened] : open_) close(opened.fd);
}

absl::StatusOr<int> HostRows::Open(const DeviceRows& where) {
  auto it = open_.find(where.region_id);
  if (it == open_.end()) {
    if (open_.size() >= kMaxOpen) {
      auto oldest = std::min_element(open_.begin(), open_.end(), [](const auto& a, const auto& b) {
        return a.second.last_use < b.second.last_use;
      });
      close(oldest->second.fd);
      open_.erase(oldest);
    }
    const HostShmHandle h = where.host_shm();
    const std::string path = absl::StrCat("/proc/", h.pid, "/fd/", h.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(RegionName(where), ": cannot open ", path,
                       " (rank 0's descriptor of the object): ", std::strerror(errno)));
    }
    it = open_.emplace(where.region_id, Opened{fd, 0}).first;
  }
  it->second.last_use = ++uses_;
  return it->second.fd;
}

absl::Status HostRows::ReadInputs(const DeviceRowTable& table, int64_t n, kernels::Buffer& x) {
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  bool first = true;
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output != 0 || !s.where.in_host_shm()) continue;
    // The staging buffers are free once the device has done what was queued before.
    if (std::exchange(first, false)) EPSERVE_RETURN_IF_ERROR(rt_.Finish());
    EPSERVE_ASSIGN_OR_RETURN(const size_t bytes, SegmentBytes(s, n, hidden_, "shared-memory"));
    EPSERVE_ASSIGN_OR_RETURN(const int fd, Open(s.where));
    // Each segment at its own rows of the staging buffers (its bytes fit in their FP32 size).
    char* rows = pinned_ + s.first_row * row_bytes;
    EPSERVE_RETURN_IF_ERROR(InParallel(threads_, bytes, [&](size_t at, size_t len) {
      DeviceRows part = s.where;
      part.offset += at;
      return ReadFully(fd, part, rows + at, len);
    }));
    if (s.where.type == common::ElementType::kFp32) {
      EPSERVE_RETURN_IF_ERROR(rt_.WriteAsync(x, s.first_row * row_bytes, rows, bytes));
      continue;
    }
    EPSERVE_RETURN_IF_ERROR(rt_.WriteAsync(staging_, s.first_row * row_bytes, rows, bytes));
    EPSERVE_RETURN_IF_ERROR(WidenSegment(rt_, staging_, s, hidden_, x));
  }
  return absl::OkStatus();
}

absl::Status HostRows::WriteOutputs(const DeviceRowTable& table, int64_t n,
                                    const kernels::Buffer& y) {
  const size_t row_bytes = static_cast<size_t>(hidden_) * sizeof(float);
  for (int64_t i = 0; i < table.count; ++i) {
    const DeviceRowSegment& s = table.segment(i);
    if (s.output == 0 || !s.where.in_host_shm()) continue;
    EPSERVE_ASSIGN_OR_RETURN(const size_t bytes, SegmentBytes(s, n, hidden_, "shared-memory"));
    const bool fp32 = s.where.type == common::ElementType::kFp32;
    if (!fp32) EPSERVE_RETURN_IF_ERROR(NarrowSegment(rt_, y, s, hidden_, staging_));
    // Read waits for the narrowing queued before it.
    char* rows = pinned_ + s.first_row * row_bytes;
    EPSERVE_RETURN_IF_ERROR(rt_.Read(fp32 ? y : staging_, s.first_row * row_bytes, rows, bytes));
    EPSERVE_ASSIGN_OR_RETURN(const int fd, Open(s.where));
    EPSERVE_RETURN_IF_ERROR(InParallel(threads_, bytes, [&](size_t at, size_t len) {
      DeviceRows part = s.where;
      part.offset += at;
      return WriteFully(fd, part, rows + at, len);
    }));
  }
  return absl::OkStatus();
}

}  // namespace epserve::worker
