// A worker's side of clients' system shared memory (Triton's system shared-memory extension)
// where workers take such rows themselves (--workers-read-shm; worker/device_rows.h): the rows
// of its part of a batch that a DeviceRowTable places in a client's object are read from it
// into the worker's FP32 input rows, and its output rows written into it, converted on the
// device to and from the request's element type as rank 0 converts rows in host memory (the
// same bits). Rank 0 then copies none of them: a request's bytes cross the host once each way,
// in its own element type, where they crossed it three times as FP32 through rank 0's copies
// and the heap.
//
// Every worker is on rank 0's host (the shm heap). The object is opened through rank 0's own
// descriptor of it (/proc/<pid>/fd/<fd>), so it is the object rank 0 registered even where
// the client unlinked its name since, and kept open by registration (region_id), up to
// kMaxOpen, the least recently used closed first. It is read and written with pread and
// pwrite, never mapped, so that an owner that shrinks its object under a batch causes no
// fault: the rows past its end read as zeros and are not written, and rank 0 answers that
// request (and only it) with an error, finding the object smaller than its region
// (SharedMemoryRegion::CheckIntact). What that misses: an owner that shrinks its object and
// grows it back before the answer gets zeros in its answer without an error (rank 0's own
// mapping marks a fault; these reads cannot), and one that shrinks it between the write's
// size check and the write gets the object grown back by the write.
// Not thread-safe: the worker's batch thread uses it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/runtime.h"
#include "worker/device_rows.h"

namespace epserve::worker {

class HostRows {
 public:
  static constexpr size_t kMaxOpen = 64;

  // For batches of up to max_rows rows of `hidden` values: a staging buffer on the device and
  // one in pinned host memory, each max_rows rows of FP32. A large segment is read and
  // written on up to `host_threads` threads.
  static absl::StatusOr<std::unique_ptr<HostRows>> Create(kernels::Runtime& rt, int64_t max_rows,
                                                          int64_t hidden, int host_threads);
  ~HostRows();  // closes what it opened

  // The kHostShm input segments of `table` (rows of the worker's part, n rows) into x
  // [n][hidden] FP32, queued on the runtime's queue. INTERNAL where a segment lies outside the
  // batch, FAILED_PRECONDITION where the object cannot be opened.
  absl::Status ReadInputs(const DeviceRowTable& table, int64_t n, kernels::Buffer& x);
  // The kHostShm output segments' rows of y [n][hidden] FP32 into the clients' objects, there
  // on return.
  absl::Status WriteOutputs(const DeviceRowTable& table, int64_t n, const kernels::Buffer& y);

 private:
  HostRows(kernels::Runtime& rt, int64_t hidden, int threads)
      : rt_(rt), hidden_(hidden), threads_(threads) {}
  // The descriptor of the object `where` names (opened here on first use).
  absl::StatusOr<int> Open(const DeviceRows& where);

  kernels::Runtime& rt_;
  const int64_t hidden_;
  const int threads_;
  kernels::Buffer staging_;  // [max_rows][hidden] FP32 bytes on the device
  char* pinned_ = nullptr;   // as many in pinned host memory (Runtime::AllocatePinnedHost)
  struct Opened {
    int fd = -1;
    uint64_t last_use = 0;
  };
  std::map<uint64_t, Opened> open_;  // by region_id
  uint64_t uses_ = 0;
};

}  // namespace epserve::worker
