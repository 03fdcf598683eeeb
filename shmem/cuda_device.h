// One CUDA device through the CUDA driver API, loaded at run time (libcuda.so.1): the
// primary context of a device, memory another API or process can import (POSIX file
// descriptors of the virtual memory API), and KServe's CUDA shared memory, a client's
// allocation opened from its IPC handle (cudaIpcMemHandle_t, 64 bytes). The CUDA toolkit's
// cuda.h is needed at build time only (EPSERVE_HAVE_CUDA_DRIVER_API); without it, or without
// a driver at run time, every call answers why not and nothing else needs CUDA.
//
// The context is made current on the calling thread by each call, so one object may be used
// from any thread (one at a time: not thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epserve::shmem {

class CudaDevice {
 public:
  // Bytes of a CUDA IPC memory handle.
  static constexpr size_t kIpcHandleBytes = 64;

  // Whether this build has the driver API at all.
  static bool Built();
  // How many CUDA devices the driver sees (loading it); why not where there is none.
  static absl::StatusOr<int> DeviceCount();
  // The device with this ordinal, or with this 16-byte UUID (the OpenCL device's).
  static absl::StatusOr<std::unique_ptr<CudaDevice>> ByOrdinal(int ordinal);
  static absl::StatusOr<std::unique_ptr<CudaDevice>> ByUuid(absl::string_view uuid);
  ~CudaDevice();  // closes what it opened, frees what it made
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  // Device memory of at least *bytes (rounded up to the granularity, written back), exported
  // as a file descriptor (owned by this object, valid while it lives) and, with `map`, mapped
  // into this context at *address.
  absl::StatusOr<int> MakeExportable(size_t* bytes, bool map, uint64_t* address = nullptr);

  // A client's allocation from its IPC handle (kIpcHandleBytes), opened in this context
  // (from another device through peer access): its address here and its size. Opening one
  // handle again returns the same address (the driver counts the opens); each open needs a
  // CloseIpc. INVALID_ARGUMENT when the driver refuses the handle, naming why.
  struct IpcMapping {
    uint64_t address = 0;
    size_t bytes = 0;
  };
  absl::StatusOr<IpcMapping> OpenIpc(absl::string_view handle);
  void CloseIpc(uint64_t address);

  // Copies `bytes` from device address `src` to `dst` and waits for the copy's end.
  absl::Status Copy(uint64_t dst, uint64_t src, size_t bytes);

 private:
  CudaDevice() = default;
  absl::Status MakeCurrent() const;
  struct State;  // the driver's handles (cuda.h types)
  std::unique_ptr<State> state_;
  int ordinal_ = -1;
};

}  // namespace epserve::shmem
