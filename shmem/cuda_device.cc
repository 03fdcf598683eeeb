#include "shmem/cuda_device.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

// Set by shmem/CMakeLists.txt where the CUDA toolkit's cuda.h is found.
#ifndef EPSERVE_HAVE_CUDA_DRIVER_API
#define EPSERVE_HAVE_CUDA_DRIVER_API 0
#endif
#if EPSERVE_HAVE_CUDA_DRIVER_API
#include <cuda.h>
#endif

namespace epserve::shmem {

bool CudaDevice::Built() { return EPSERVE_HAVE_CUDA_DRIVER_API; }

#if EPSERVE_HAVE_CUDA_DRIVER_API
namespace {

// The driver's entry points, loaded once per process. cuda.h maps some names to versioned
// symbols (cuMemcpyDtoD -> cuMemcpyDtoD_v2): the two-step stringizing looks up the symbol
// the header means.
struct Driver {
#define EPSERVE_CUDA_STR2(x) #x
#define EPSERVE_CUDA_STR(x) EPSERVE_CUDA_STR2(x)
// One entry point a line, left as written: clang-format 14 reflows this list differently from
// one run to the next.
// clang-format off
#define EPSERVE_CUDA_FNS(X) \
  X(cuInit) \
  X(cuGetErrorName) \
  X(cuDeviceGetCount) \
  X(cuDeviceGet) \
  X(cuDeviceGetUuid) \
  X(cuDevicePrimaryCtxRetain) \
  X(cuDevicePrimaryCtxRelease) \
  X(cuCtxSetCurrent) \
  X(cuCtxSynchronize) \
  X(cuMemGetAllocationGranularity) \
  X(cuMemCreate) \
  X(cuMemExportToShareableHandle) \
  X(cuMemRelease) \
  X(cuMemAddressReserve) \
  X(cuMemAddressFree) \
  X(cuMemMap) \
  X(cuMemUnmap) \
  X(cuMemSetAccess) \
  X(cuIpcOpenMemHandle) \
  X(cuIpcCloseMemHandle) \
  X(cuMemGetAddressRange) \
  X(cuMemcpyDtoD)
// clang-format on
#define EPSERVE_CUDA_MEMBER(fn) decltype(&::fn) fn = nullptr;
  EPSERVE_CUDA_FNS(EPSERVE_CUDA_MEMBER)
#undef EPSERVE_CUDA_MEMBER
  absl::Status loaded;

  absl::Status Load() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("the CUDA driver (libcuda.so.1) could not be loaded: ", dlerror()));
    }
    // libcuda stays loaded: drivers do not expect to be unloaded while the process runs.
#define EPSERVE_CUDA_LOAD(fn)                                                         \
  fn = reinterpret_cast<decltype(fn)>(dlsym(lib, EPSERVE_CUDA_STR(fn)));              \
  if (fn == nullptr) {                                                                \
    return absl::FailedPreconditionError(                                             \
        absl::StrCat("the CUDA driver has no ", EPSERVE_CUDA_STR(fn), " (too old)")); \
  }
    EPSERVE_CUDA_FNS(EPSERVE_CUDA_LOAD)
#undef EPSERVE_CUDA_LOAD
    return Check(cuInit(0), "cuInit");
  }

  absl::Status Check(CUresult r, const char* call) const {
    if (r == CUDA_SUCCESS) return absl::OkStatus();
    const char* name = nullptr;
    if (cuGetErrorName != nullptr) cuGetErrorName(r, &name);
    return absl::FailedPreconditionError(name != nullptr
                                             ? absl::StrCat(call, " failed: ", name)
                                             : absl::StrCat(call, " failed: CUDA error ", int{r}));
  }
};

absl::StatusOr<const Driver*> TheDriver() {
  static Driver* driver = [] {
    auto* d = new Driver;  // never freed: the driver stays loaded
    d->loaded = d->Load();
    return d;
  }();
  if (!driver->loaded.ok()) return driver->loaded;
  return driver;
}

}  // namespace

struct CudaDevice::State {
  const Driver* cu = nullptr;
  CUdevice device = 0;
  CUcontext context = nullptr;
  struct Made {
    CUmemGenericAllocationHandle handle = 0;
    int fd = -1;
    CUdeviceptr address = 0;  // 0: not mapped here
    size_t bytes = 0;
  };
  std::vector<Made> made;

  ~State() {
    if (cu == nullptr) return;
    if (context != nullptr) cu->cuCtxSetCurrent(context);
    for (const Made& m : made) {
      if (m.address != 0) {
        cu->cuMemUnmap(m.address, m.bytes);
        cu->cuMemAddressFree(m.address, m.bytes);
      }
      if (m.fd >= 0) close(m.fd);
      cu->cuMemRelease(m.handle);
    }
    if (context != nullptr) cu->cuDevicePrimaryCtxRelease(device);
  }
};

absl::StatusOr<int> CudaDevice::DeviceCount() {
  EPSERVE_ASSIGN_OR_RETURN(const Driver* cu, TheDriver());
  int count = 0;
  EPSERVE_RETURN_IF_ERROR(cu->Check(cu->cuDeviceGetCount(&count), "cuDeviceGetCount"));
  return count;
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::ByOrdinal(int ordinal) {
  EPSERVE_ASSIGN_OR_RETURN(const int count, DeviceCount());
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", ordinal, " does not exist (",
                                                   count, " devices, 0 to ", count - 1, ")"));
  }
  std::unique_ptr<CudaDevice> d(new CudaDevice);
  d->state_ = std::make_unique<State>();
  State& s = *d->state_;
  EPSERVE_ASSIGN_OR_RETURN(s.cu, TheDriver());
  EPSERVE_RETURN_IF_ERROR(s.cu->Check(s.cu->cuDeviceGet(&s.device, ordinal), "cuDeviceGet"));
  EPSERVE_RETURN_IF_ERROR(s.cu->Check(s.cu->cuDevicePrimaryCtxRetain(&s.context, s.device),
                                      "cuDevicePrimaryCtxRetain"));
  d->ordinal_ = ordinal;
  return d;
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::ByUuid(absl::string_view uuid) {
  EPSERVE_ASSIGN_OR_RETURN(const int count, DeviceCount());
  EPSERVE_ASSIGN_OR_RETURN(const Driver* cu, TheDriver());
  for (int i = 0; i < count; ++i) {
    CUdevice d = 0;
    CUuuid id = {};
    EPSERVE_RETURN_IF_ERROR(cu->Check(cu->cuDeviceGet(&d, i), "cuDeviceGet"));
    EPSERVE_RETURN_IF_ERROR(cu->Check(cu->cuDeviceGetUuid(&id, d), "cuDeviceGetUuid"));
    if (uuid.size() == sizeof(id.bytes) && std::memcmp(id.bytes, uuid.data(), uuid.size()) == 0) {
      return ByOrdinal(i);
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat("none of the ", count, " CUDA devices has the OpenCL device's UUID"));
}

CudaDevice::~CudaDevice() = default;

absl::Status CudaDevice::MakeCurrent() const {
  return state_->cu->Check(state_->cu->cuCtxSetCurrent(state_->context), "cuCtxSetCurrent");
}

absl::StatusOr<int> CudaDevice::MakeExportable(size_t* bytes, bool map, uint64_t* address) {
  EPSERVE_RETURN_IF_ERROR(MakeCurrent());
  const Driver& cu = *state_->cu;
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = state_->device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  EPSERVE_RETURN_IF_ERROR(cu.Check(
      cu.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
      "cuMemGetAllocationGranularity"));
  granularity = std::max<size_t>(granularity, 1);
  *bytes = (std::max<size_t>(*bytes, 1) + granularity - 1) / granularity * granularity;
  State::Made m;
  m.bytes = *bytes;
  EPSERVE_RETURN_IF_ERROR(cu.Check(cu.cuMemCreate(&m.handle, m.bytes, &prop, 0), "cuMemCreate"));
  state_->made.push_back(m);
  State::Made& made = state_->made.back();
  EPSERVE_RETURN_IF_ERROR(
      cu.Check(cu.cuMemExportToShareableHandle(&made.fd, made.handle,
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               "cuMemExportToShareableHandle"));
  if (!map) return made.fd;
  CUdeviceptr at = 0;
  EPSERVE_RETURN_IF_ERROR(
      cu.Check(cu.cuMemAddressReserve(&at, made.bytes, granularity, 0, 0), "cuMemAddressReserve"));
  if (absl::Status s = cu.Check(cu.cuMemMap(at, made.bytes, 0, made.handle, 0), "cuMemMap");
      !s.ok()) {
    cu.cuMemAddressFree(at, made.bytes);
    return s;
  }
  made.address = at;  // unmapped and freed with the rest
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EPSERVE_RETURN_IF_ERROR(
      cu.Check(cu.cuMemSetAccess(at, made.bytes, &access, 1), "cuMemSetAccess"));
  if (address != nullptr) *address = static_cast<uint64_t>(at);
  return made.fd;
}

absl::StatusOr<CudaDevice::IpcMapping> CudaDevice::OpenIpc(absl::string_view handle) {
  if (handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC memory handle is ", kIpcHandleBytes,
                                                   " bytes, got ", handle.size()));
  }
  EPSERVE_RETURN_IF_ERROR(MakeCurrent());
  const Driver& cu = *state_->cu;
  CUipcMemHandle h;
  static_assert(sizeof(h) == kIpcHandleBytes);
  std::memcpy(&h, handle.data(), sizeof(h));
  CUdeviceptr at = 0;
  const CUresult r = cu.cuIpcOpenMemHandle(&at, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA IPC handle could not be opened on CUDA device ", ordinal_, " (",
        cu.Check(r, "cuIpcOpenMemHandle").message(), "): ",
        r == CUDA_ERROR_ALREADY_MAPPED
            ? "an allocation open here already holds those addresses (a region of an allocation "
              "its client freed is still registered: unregister it first)"
            : "not a live allocation of a process on this host?"));
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (absl::Status s = cu.Check(cu.cuMemGetAddressRange(&base, &size, at), "cuMemGetAddressRange");
      !s.ok()) {
    cu.cuIpcCloseMemHandle(at);
    return s;
  }
  return IpcMapping{static_cast<uint64_t>(at), size - static_cast<size_t>(at - base)};
}

void CudaDevice::CloseIpc(uint64_t address) {
  if (MakeCurrent().ok()) state_->cu->cuIpcCloseMemHandle(static_cast<CUdeviceptr>(address));
}

absl::Status CudaDevice::Copy(uint64_t dst, uint64_t src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(MakeCurrent());
  const Driver& cu = *state_->cu;
  EPSERVE_RETURN_IF_ERROR(
      cu.Check(cu.cuMemcpyDtoD(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes),
               "cuMemcpyDtoD"));
  // A copy between device addresses does not wait for itself.
  return cu.Check(cu.cuCtxSynchronize(), "cuCtxSynchronize");
}

#else  // no cuda.h at build time

namespace {
absl::Status NotBuilt() {
  return absl::UnimplementedError(
      "this build has no CUDA driver API (built without the CUDA toolkit's cuda.h)");
}
}  // namespace

struct CudaDevice::State {};
absl::StatusOr<int> CudaDevice::DeviceCount() { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::ByOrdinal(int) { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::ByUuid(absl::string_view) {
  return NotBuilt();
}
CudaDevice::~CudaDevice() = default;
absl::Status CudaDevice::MakeCurrent() const { return NotBuilt(); }
absl::StatusOr<int> CudaDevice::MakeExportable(size_t*, bool, uint64_t*) { return NotBuilt(); }
absl::StatusOr<CudaDevice::IpcMapping> CudaDevice::OpenIpc(absl::string_view) { return NotBuilt(); }
void CudaDevice::CloseIpc(uint64_t) {}
absl::Status CudaDevice::Copy(uint64_t, uint64_t, size_t) { return NotBuilt(); }

#endif

}  // namespace epserve::shmem
