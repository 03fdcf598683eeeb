#include "server/cuda_shared_memory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/clip.h"
#include "shmem/cuda_device.h"

namespace epserve::server {

CudaMemoryOpener DriverCudaMemoryOpener() {
  // One device object per CUDA device used, shared by the registrations (and their closes).
  struct Devices {
    std::mutex mu;
    std::map<int64_t, std::unique_ptr<shmem::CudaDevice>> open;  // guarded by mu
  };
  auto devices = std::make_shared<Devices>();
  return
      [devices](absl::string_view handle, int64_t device_id) -> absl::StatusOr<OpenedCudaMemory> {
        std::lock_guard<std::mutex> lock(devices->mu);
        std::unique_ptr<shmem::CudaDevice>& device = devices->open[device_id];
        if (device == nullptr) {
          absl::StatusOr<std::unique_ptr<shmem::CudaDevice>> d =
              shmem::CudaDevice::ByOrdinal(static_cast<int>(device_id));
          if (!d.ok()) {
            devices->open.erase(device_id);
            return absl::InvalidArgumentError(
                absl::StrCat("device_id ", device_id, ": ", d.status().message()));
          }
          device = *std::move(d);
        }
        absl::StatusOr<shmem::CudaDevice::IpcMapping> m = device->OpenIpc(handle);
        if (!m.ok()) return m.status();
        shmem::CudaDevice* dev = device.get();
        const uint64_t address = m->address;
        return OpenedCudaMemory{m->bytes, [devices, dev, address] {
                                  std::lock_guard<std::mutex> l(devices->mu);
                                  dev->CloseIpc(address);
                                }};
      };
}

CudaSharedMemoryRegion::~CudaSharedMemoryRegion() {
  if (close_) close_();
}

absl::Status CudaSharedMemoryRegion::CheckSpan(uint64_t at, uint64_t bytes,
                                               const std::string& what) const {
  if (at > byte_size_ || bytes > byte_size_ - at) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", at, ", ", at + bytes,
                                                   ") lie outside CUDA shared memory region '",
                                                   Clip(name_), "' of ", byte_size_, " bytes"));
  }
  return absl::OkStatus();
}

CudaSharedMemoryRegistry::CudaSharedMemoryRegistry(std::string why_unavailable, size_t max_regions)
    : max_regions_(max_regions), why_unavailable_(std::move(why_unavailable)) {}

void CudaSharedMemoryRegistry::set_available(CudaMemoryOpener opener) {
  std::lock_guard<std::mutex> lock(mu_);
  opener_ = std::move(opener);
  why_unavailable_.clear();
}

bool CudaSharedMemoryRegistry::available() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opener_ != nullptr;
}

absl::Status CudaSharedMemoryRegistry::Unavailable() const {
  return absl::UnimplementedError(
      absl::StrCat("CUDA shared memory is not served here: ", why_unavailable_));
}

absl::Status CudaSharedMemoryRegistry::Register(const std::string& name,
                                                absl::string_view raw_handle, int64_t device_id,
                                                uint64_t byte_size) {
  CudaMemoryOpener opener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (opener_ == nullptr) return Unavailable();
    opener = opener_;
    if (name.empty()) return absl::InvalidArgumentError("name: must not be empty");
    if (regions_.contains(name)) {
      return absl::AlreadyExistsError(
          absl::StrCat("a shared memory region '", Clip(name), "' is registered already"));
    }
  }
  if (raw_handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle: a CUDA IPC memory handle is ",
                                                   kIpcHandleBytes, " bytes, got ",
                                                   raw_handle.size()));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  if (device_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device_id: must be >= 0, got ", device_id));
  }
  // Opened outside the lock: a first open makes a CUDA context (tenths of a second).
  absl::StatusOr<OpenedCudaMemory> opened = opener(raw_handle, device_id);
  if (!opened.ok()) {
    return absl::Status(
        opened.status().code(),
        absl::StrCat("CUDA shared memory region '", Clip(name), "': ", opened.status().message()));
  }
  std::shared_ptr<CudaSharedMemoryRegion> r(new CudaSharedMemoryRegion);
  r->close_ = std::move(opened->close);  // closed by r's end on every path below
  if (byte_size > opened->bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte_size: ", byte_size, " bytes past the end of the allocation the handle names (",
        opened->bytes, " bytes)"));
  }
  r->name_ = name;
  r->handle_ = std::string(raw_handle);
  r->device_id_ = device_id;
  r->byte_size_ = byte_size;
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.contains(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("a shared memory region '", Clip(name), "' is registered already"));
  }
  if (regions_.size() >= max_regions_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("at most ", max_regions_, " CUDA shared memory regions may be registered"));
  }
  r->id_ = next_id_++;
  regions_.Insert(name, std::move(r));
  return absl::OkStatus();
}

absl::Status CudaSharedMemoryRegistry::Unregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (opener_ == nullptr) return Unavailable();
  regions_.Remove(name);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> CudaSharedMemoryRegistry::Find(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.Find(name);
}

absl::StatusOr<std::vector<CudaRegionStatus>> CudaSharedMemoryRegistry::Status(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (opener_ == nullptr) return Unavailable();
  return regions_.Statuses(name, "CUDA ", [](const CudaSharedMemoryRegion& r) {
    return CudaRegionStatus{r.name(), r.device_id(), r.byte_size()};
  });
}

}  // namespace epserve::server
