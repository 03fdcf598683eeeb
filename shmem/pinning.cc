#include "shmem/pinning.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace epserve::shmem {
namespace {

// The few CUDA driver entry points used, as the driver API declares them (cuda.h).
using CuResult = int;
using CuDevice = int;
using CuContext = void*;
constexpr unsigned kHostRegisterPortable = 0x01;  // CU_MEMHOSTREGISTER_PORTABLE

struct CudaDriver {
  CuResult (*init)(unsigned) = nullptr;
  CuResult (*device_get)(CuDevice*, int) = nullptr;
  CuResult (*primary_ctx_retain)(CuContext*, CuDevice) = nullptr;
  CuResult (*ctx_set_current)(CuContext) = nullptr;
  CuResult (*host_register)(void*, size_t, unsigned) = nullptr;
  absl::Status status;
};

const CudaDriver& Driver() {
  static CudaDriver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.status = absl::UnavailableError("no CUDA driver (libcuda.so.1) on this host");
      return;
    }
    auto sym = [&](const char* name, auto& fn) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      return fn != nullptr;
    };
    if (!sym("cuInit", d.init) || !sym("cuDeviceGet", d.device_get) ||
        !sym("cuDevicePrimaryCtxRetain", d.primary_ctx_retain) ||
        !sym("cuCtxSetCurrent", d.ctx_set_current) ||
        !sym("cuMemHostRegister_v2", d.host_register)) {
      d.status = absl::UnavailableError("the CUDA driver lacks cuMemHostRegister_v2");
      return;
    }
    CuDevice dev = 0;
    CuContext ctx = nullptr;
    if (CuResult r = d.init(0); r != 0) {
      d.status = absl::UnavailableError(absl::StrCat("cuInit: CUDA error ", r));
    } else if (r = d.device_get(&dev, 0); r != 0) {
      d.status = absl::UnavailableError(absl::StrCat("cuDeviceGet: CUDA error ", r));
    } else if (r = d.primary_ctx_retain(&ctx, dev); r != 0) {
      d.status = absl::UnavailableError(absl::StrCat("cuDevicePrimaryCtxRetain: CUDA error ", r));
    }
  });
  return d;
}

}  // namespace

absl::Status PinForGpuTransfers(void* addr, size_t bytes) {
  const CudaDriver& d = Driver();
  if (!d.status.ok()) return d.status;
  CuContext ctx = nullptr;
  CuDevice dev = 0;
  if (CuResult r = d.device_get(&dev, 0);
      r != 0 || d.primary_ctx_retain(&ctx, dev) != 0 || d.ctx_set_current(ctx) != 0) {
    return absl::UnavailableError("no current CUDA context for cuMemHostRegister");
  }
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + bytes + page - 1) / page * page;
  if (CuResult r =
          d.host_register(reinterpret_cast<void*>(begin), end - begin, kHostRegisterPortable);
      r != 0) {
    return absl::UnavailableError(
        absl::StrCat("cuMemHostRegister of ", end - begin, " bytes: CUDA error ", r));
  }
  return absl::OkStatus();
}

}  // namespace epserve::shmem
