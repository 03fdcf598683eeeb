// Triton's CUDA shared-memory extension: a client on the same host registers an allocation of
// its GPU memory by its CUDA IPC handle (cudaIpcMemHandle_t, 64 bytes), the device it is on
// and a size, and requests name the region, an offset and a size for their input or
// moe_output instead of carrying the bytes. Rank 0 never copies those rows: the GPU workers
// open the allocation themselves and read the input from it and write the output into it
// (worker/cuda_rows.h); rank 0 only checks the requests against the registration.
//
// Registering opens the handle in rank 0 (the opener; shmem::CudaDevice by default): a handle
// that names no live allocation, a device the host does not have, or a size past the
// allocation's end is refused then, naming the field. Rank 0 keeps its mapping open until the
// region is unregistered and no request uses it any more: the driver keeps the allocation
// alive for as long, so a client that frees it while a request waits has its answer written
// into memory that nothing else can be given.
//
// Served only where every worker can reach CUDA memory (its OpenCL device is a CUDA GPU):
// elsewhere, and in a build without the CUDA driver API, every call answers UNIMPLEMENTED with
// the reason (set_unavailable). Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/region_map.h"
#include "shmem/cuda_device.h"

namespace epserve::server {

// What opening a client's handle found: the allocation's size from the handle's address on,
// and how to close rank 0's mapping of it.
struct OpenedCudaMemory {
  uint64_t bytes = 0;
  std::function<void()> close;
};
// Opens `handle` (raw IPC handle bytes) on CUDA device `device_id`.
using CudaMemoryOpener =
    std::function<absl::StatusOr<OpenedCudaMemory>(absl::string_view handle, int64_t device_id)>;
// The opener through the CUDA driver (shmem::CudaDevice), one context per device used.
CudaMemoryOpener DriverCudaMemoryOpener();

class CudaSharedMemoryRegion {
 public:
  ~CudaSharedMemoryRegion();  // closes rank 0's mapping
  CudaSharedMemoryRegion(const CudaSharedMemoryRegion&) = delete;
  CudaSharedMemoryRegion& operator=(const CudaSharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& handle() const { return handle_; }  // kIpcHandleBytes raw bytes
  int64_t device_id() const { return device_id_; }
  uint64_t byte_size() const { return byte_size_; }
  // Numbers the registration (from 1, never reused): the workers' key for what they opened.
  uint64_t id() const { return id_; }

  // OK when bytes [at, at + bytes) lie inside the region; INVALID_ARGUMENT naming `what`.
  absl::Status CheckSpan(uint64_t at, uint64_t bytes, const std::string& what) const;

 private:
  friend class CudaSharedMemoryRegistry;
  CudaSharedMemoryRegion() = default;
  std::string name_, handle_;
  int64_t device_id_ = 0;
  uint64_t byte_size_ = 0, id_ = 0;
  std::function<void()> close_;
};

struct CudaRegionStatus {
  std::string name;
  int64_t device_id = 0;
  uint64_t byte_size = 0;
};

class CudaSharedMemoryRegistry {
 public:
  static constexpr size_t kIpcHandleBytes = shmem::CudaDevice::kIpcHandleBytes;

  // Until set_available: every call UNIMPLEMENTED with `why`.
  explicit CudaSharedMemoryRegistry(std::string why_unavailable, size_t max_regions = 1024);
  // Serves registrations, opening handles with `opener`.
  void set_available(CudaMemoryOpener opener);
  bool available() const;

  // INVALID_ARGUMENT for an empty name, a handle not kIpcHandleBytes long, a zero size, a
  // negative device, or a size past the allocation's end; the opener's error for a handle or
  // device it cannot open (naming them); ALREADY_EXISTS for a name in use; RESOURCE_EXHAUSTED
  // beyond max_regions.
  absl::Status Register(const std::string& name, absl::string_view raw_handle, int64_t device_id,
                        uint64_t byte_size);
  // Forgets `name` (all when empty; an unknown name is no error, as in Triton); requests that
  // use it keep it until they end.
  absl::Status Unregister(const std::string& name);
  // NOT_FOUND naming it when none is registered.
  absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> Find(const std::string& name) const;
  // Every region (name empty) or the one named; NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<CudaRegionStatus>> Status(const std::string& name) const;

 private:
  absl::Status Unavailable() const;  // guarded by mu_
  const size_t max_regions_;
  mutable std::mutex mu_;
  std::string why_unavailable_;  // guarded by mu_, as the rest
  CudaMemoryOpener opener_;
  uint64_t next_id_ = 1;
  RegionMap<CudaSharedMemoryRegion> regions_;
};

}  // namespace epserve::server
