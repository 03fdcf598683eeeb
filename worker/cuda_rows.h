// A GPU worker's side of clients' CUDA memory (KServe's CUDA shared memory,
// worker/device_rows.h): the rows of its part of a batch that a DeviceRowTable places in a
// client's allocation are read from it into the worker's FP32 input rows, and its output rows
// written into it, device to device, converted on the device to and from the request's
// element type as rank 0 converts rows in host memory (the same bits).
//
// The worker's OpenCL buffers have no CUDA address, so the rows pass through a staging buffer
// that is both: device memory made through the CUDA driver (shmem::CudaDevice, exportable)
// and imported into OpenCL (kernels::Runtime::ImportOpaqueFd). A client's allocation is opened
// from its IPC handle once and kept open (the driver keeps it alive for as long: a client
// that frees it meanwhile has its rows read from, and written into, memory nothing else can
// be given), up to kMaxOpen allocations, the least recently used closed first, and closed
// at once where the driver refuses a new handle because an old one still maps its addresses
// (a client freed an allocation and made another in its place).
// Not thread-safe: the worker's batch thread uses it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/runtime.h"
#include "shmem/cuda_device.h"
#include "worker/device_rows.h"

namespace epserve::worker {

class CudaRows {
 public:
  static constexpr size_t kMaxOpen = 64;

  // For a worker whose OpenCL device is a CUDA GPU (its UUID names one, it imports memory by
  // file descriptor, the build has the driver API), for batches of up to max_rows rows of
  // `hidden` values; else FAILED_PRECONDITION or UNIMPLEMENTED saying why not.
  static absl::StatusOr<std::unique_ptr<CudaRows>> Create(kernels::Runtime& rt, int64_t max_rows,
                                                          int64_t hidden);
  ~CudaRows();

  // The CUDA input segments of `table` (rows of the worker's part, n rows) into x [n][hidden] FP32.
  // INVALID_ARGUMENT where a segment lies outside the batch or its client's allocation.
  absl::Status ReadInputs(const DeviceRowTable& table, int64_t n, kernels::Buffer& x);
  // The CUDA output segments' rows of y [n][hidden] FP32 into the clients' memory, there on return.
  absl::Status WriteOutputs(const DeviceRowTable& table, int64_t n, const kernels::Buffer& y);

 private:
  CudaRows(kernels::Runtime& rt, int64_t hidden) : rt_(rt), hidden_(hidden) {}
  // The device address of `bytes` bytes of `where` (its allocation opened here), or why not.
  absl::StatusOr<uint64_t> Address(const DeviceRows& where, size_t bytes);

  kernels::Runtime& rt_;
  const int64_t hidden_;
  std::unique_ptr<shmem::CudaDevice> cuda_;
  kernels::Buffer staging_;       // [max_rows][hidden] FP32, the OpenCL view
  uint64_t staging_address_ = 0;  // the CUDA view
  struct Opened {
    uint64_t address = 0;
    size_t bytes = 0;
    uint64_t last_use = 0;
  };
  std::map<std::string, Opened> open_;  // by IPC handle
  uint64_t uses_ = 0;
  uint64_t first_use_of_step_ = 0;  // the first use of the running ReadInputs / WriteOutputs
  // Closes every allocation the running step has not used; how many.
  size_t CloseUnused();
};

}  // namespace epserve::worker
