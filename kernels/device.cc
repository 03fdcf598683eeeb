// Device discovery and choice (kernels/detail/device.h) and DeviceInfo (kernels/runtime.h).
#include "kernels/detail/device.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"

namespace epserve::kernels {
namespace {

absl::StatusOr<std::string> PlatformString(cl_platform_id platform, cl_platform_info what) {
  size_t size = 0;
  CL_CHECK(clGetPlatformInfo(platform, what, 0, nullptr, &size));
  std::string s(size, '\0');
  CL_CHECK(clGetPlatformInfo(platform, what, size, s.data(), nullptr));
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

absl::StatusOr<std::string> DeviceString(cl_device_id device, cl_device_info what) {
  size_t size = 0;
  CL_CHECK(clGetDeviceInfo(device, what, 0, nullptr, &size));
  std::string s(size, '\0');
  CL_CHECK(clGetDeviceInfo(device, what, size, s.data(), nullptr));
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

// A cl_uint attribute of cl_nv_device_attribute_query, or 0 where the device lacks it.
int NvAttribute(cl_device_id device, const std::string& extensions, cl_device_info what) {
  if (extensions.find("cl_nv_device_attribute_query") == std::string::npos) return 0;
  cl_uint value = 0;
  if (clGetDeviceInfo(device, what, sizeof(value), &value, nullptr) != CL_SUCCESS) return 0;
  return static_cast<int>(value);
}
// NVIDIA's attributes (cl_ext.h's *_NV).
constexpr cl_device_info kNvComputeCapabilityMajor = 0x4000;
constexpr cl_device_info kNvComputeCapabilityMinor = 0x4001;
constexpr cl_device_info kNvRegistersPerBlock = 0x4002;

// The device's 16-byte UUID (cl_khr_device_uuid), or "" where it has none.
std::string DeviceUuid(cl_device_id device, const std::string& extensions) {
  if (extensions.find("cl_khr_device_uuid") == std::string::npos) return "";
  constexpr cl_device_info kUuid = 0x106A;  // CL_DEVICE_UUID_KHR
  std::string uuid(16, '\0');
  if (clGetDeviceInfo(device, kUuid, uuid.size(), uuid.data(), nullptr) != CL_SUCCESS) return "";
  return uuid;
}

// What DeviceInfo says of device `d` of platform `p` (target_isa aside).
absl::StatusOr<DeviceInfo> ReadDeviceInfo(cl_device_id device, int p, int d,
                                          const std::string& platform_name) {
  DeviceInfo info;
  info.platform_index = p;
  info.device_index = d;
  info.platform_name = platform_name;
  EPSERVE_ASSIGN_OR_RETURN(info.device_name, DeviceString(device, CL_DEVICE_NAME));
  EPSERVE_ASSIGN_OR_RETURN(info.device_version, DeviceString(device, CL_DEVICE_VERSION));
  EPSERVE_ASSIGN_OR_RETURN(info.driver_version, DeviceString(device, CL_DRIVER_VERSION));
  cl_device_type type = 0;
  CL_CHECK(clGetDeviceInfo(device, CL_DEVICE_TYPE, sizeof(type), &type, nullptr));
  info.is_gpu = (type & CL_DEVICE_TYPE_GPU) != 0;
  info.is_cpu = (type & CL_DEVICE_TYPE_CPU) != 0;
  EPSERVE_ASSIGN_OR_RETURN(const std::string extensions,
                           DeviceString(device, CL_DEVICE_EXTENSIONS));
  // major * 10 + minor, 0 where the device does not say.
  const int nv_major = NvAttribute(device, extensions, kNvComputeCapabilityMajor);
  info.nv_compute_capability =
      nv_major > 0 ? nv_major * 10 + NvAttribute(device, extensions, kNvComputeCapabilityMinor) : 0;
  info.nv_registers_per_block = NvAttribute(device, extensions, kNvRegistersPerBlock);
  info.uuid = DeviceUuid(device, extensions);
  info.imports_opaque_fd = extensions.find("cl_khr_external_memory_opaque_fd") != std::string::npos;
  cl_uint width = 1;
  cl_uint units = 1;
  CL_CHECK(
      clGetDeviceInfo(device, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT, sizeof(width), &width, nullptr));
  CL_CHECK(clGetDeviceInfo(device, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof(units), &units, nullptr));
  info.native_float_width = static_cast<int>(width);
  info.compute_units = static_cast<int>(units);
  cl_ulong cache = 0;
  if (clGetDeviceInfo(device, CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, sizeof(cache), &cache, nullptr) ==
      CL_SUCCESS) {
    info.cache_bytes = cache;
  }
  return info;
}

std::string DescribeAll(const std::vector<detail::FoundDevice>& devices) {
  if (devices.empty()) return "none (no OpenCL platform or device is installed)";
  std::vector<std::string> parts;
  for (const detail::FoundDevice& device : devices) parts.push_back(device.info.Describe());
  return absl::StrJoin(parts, "; ");
}

// What the device's compiler targets, read from its predefined macros by a one-work-item
// kernel: out[0] its vector extensions, 0 unknown (not x86, or the probe did not run), 1 sse,
// 2 avx, 3 avx2, 4 avx512f; out[1] clang's major version (0 for another compiler).
constexpr char kTargetProbeSource[] = R"(
__kernel void target_probe(__global int* out) {
#ifdef __clang_major__
  out[1] = __clang_major__;
#else
  out[1] = 0;
#endif
  int isa = 0;
#if defined(__x86_64__) || defined(__i386__)
  isa = 1;
#endif
#ifdef __AVX__
  isa = 2;
#endif
#ifdef __AVX2__
  isa = 3;
#endif
#ifdef __AVX512F__
  isa = 4;
#endif
  out[0] = isa;
}
)";

// Sets info.target_isa ("" where it is not x86 or the probe cannot run: its errors are not
// the caller's, the reported width then stands) and info.clang_major.
void ProbeTargetIsa(cl_context context, cl_device_id device, cl_command_queue queue,
                    DeviceInfo& info) {
  constexpr const char* kNames[] = {"", "sse", "avx", "avx2", "avx512f"};
  cl_int err = CL_SUCCESS;
  const char* src = kTargetProbeSource;
  cl_program program = clCreateProgramWithSource(context, 1, &src, nullptr, &err);
  if (err != CL_SUCCESS) return;
  cl_kernel kernel = nullptr;
  cl_mem out = nullptr;
  int got[2] = {0, 0};
  if (clBuildProgram(program, 1, &device, "", nullptr, nullptr) == CL_SUCCESS &&
      (kernel = clCreateKernel(program, "target_probe", &err), err == CL_SUCCESS) &&
      (out = clCreateBuffer(context, CL_MEM_READ_WRITE, sizeof(got), nullptr, &err),
       err == CL_SUCCESS) &&
      clSetKernelArg(kernel, 0, sizeof(out), &out) == CL_SUCCESS) {
    const size_t one = 1;
    if (clEnqueueNDRangeKernel(queue, kernel, 1, nullptr, &one, nullptr, 0, nullptr, nullptr) !=
            CL_SUCCESS ||
        clEnqueueReadBuffer(queue, out, CL_TRUE, 0, sizeof(got), got, 0, nullptr, nullptr) !=
            CL_SUCCESS) {
      got[0] = got[1] = 0;
    }
  }
  if (out != nullptr) clReleaseMemObject(out);
  if (kernel != nullptr) clReleaseKernel(kernel);
  clReleaseProgram(program);
  info.target_isa = got[0] >= 0 && got[0] <= 4 ? kNames[got[0]] : "";
  info.clang_major = std::max(got[1], 0);
}

}  // namespace

std::string DeviceInfo::Describe() const {
  return absl::StrCat(
      platform_index, ":", device_index, " ", platform_name, " / ", device_name, " (",
      is_gpu ? "gpu" : (is_cpu ? "cpu" : "other"), ", ", device_version, ", driver ",
      driver_version,
      nv_compute_capability > 0 ? absl::StrCat(", sm_", nv_compute_capability) : std::string(),
      ")");
}

absl::StatusOr<std::vector<DeviceInfo>> ListDevices() {
  EPSERVE_ASSIGN_OR_RETURN(std::vector<detail::FoundDevice> devices, detail::EnumerateDevices());
  std::vector<DeviceInfo> out;
  for (detail::FoundDevice& device : devices) out.push_back(std::move(device.info));
  return out;
}

namespace detail {

absl::StatusOr<std::vector<FoundDevice>> EnumerateDevices() {
  std::vector<FoundDevice> out;
  cl_uint num_platforms = 0;
  const cl_int err = clGetPlatformIDs(0, nullptr, &num_platforms);
  if (err == -1001 /* CL_PLATFORM_NOT_FOUND_KHR: no ICD installed */ || num_platforms == 0) {
    return out;
  }
  CL_CHECK(err);
  std::vector<cl_platform_id> platforms(num_platforms);
  CL_CHECK(clGetPlatformIDs(num_platforms, platforms.data(), nullptr));
  for (cl_uint p = 0; p < num_platforms; ++p) {
    EPSERVE_ASSIGN_OR_RETURN(std::string platform_name,
                             PlatformString(platforms[p], CL_PLATFORM_NAME));
    cl_uint num_devices = 0;
    const cl_int derr = clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 0, nullptr, &num_devices);
    if (derr == CL_DEVICE_NOT_FOUND || num_devices == 0) continue;
    CL_CHECK(derr);
    std::vector<cl_device_id> devices(num_devices);
    CL_CHECK(
        clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, num_devices, devices.data(), nullptr));
    for (cl_uint d = 0; d < num_devices; ++d) {
      EPSERVE_ASSIGN_OR_RETURN(DeviceInfo info, ReadDeviceInfo(devices[d], static_cast<int>(p),
                                                               static_cast<int>(d), platform_name));
      out.push_back({devices[d], std::move(info)});
    }
  }
  return out;
}

absl::StatusOr<FoundDevice> ChooseDevice(const std::vector<FoundDevice>& devices,
                                         absl::string_view spec, int local_rank) {
  auto none = [&](absl::StatusCode code, absl::string_view why) {
    return absl::Status(code, absl::StrCat("no OpenCL device for device='", spec, "': ", why,
                                           "; devices found: ", DescribeAll(devices)));
  };
  if (spec == "cpu" || spec == "gpu") {
    const bool want_gpu = spec == "gpu";
    std::vector<size_t> matches;
    for (size_t i = 0; i < devices.size(); ++i) {
      if (want_gpu ? devices[i].info.is_gpu : devices[i].info.is_cpu) matches.push_back(i);
    }
    if (matches.empty()) {
      return none(absl::StatusCode::kNotFound, absl::StrCat("there is no ", spec, " device"));
    }
    const size_t pick =
        want_gpu ? static_cast<size_t>(std::max(local_rank, 0)) % matches.size() : 0;
    return devices[matches[pick]];
  }
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  int platform = -1;
  int device = -1;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &platform) ||
      !absl::SimpleAtoi(parts[1], &device)) {
    return none(absl::StatusCode::kInvalidArgument,
                "expected 'cpu', 'gpu' or '<platform>:<device>' indices");
  }
  for (const FoundDevice& found : devices) {
    if (found.info.platform_index == platform && found.info.device_index == device) return found;
  }
  return none(absl::StatusCode::kNotFound, "no device has these indices");
}

void ProbeCpuTarget(cl_context context, cl_device_id device, cl_command_queue queue,
                    DeviceInfo& info) {
  if (!info.is_cpu) return;
  ProbeTargetIsa(context, device, queue, info);
  const std::string& isa = info.target_isa;
  if (!isa.empty() && isa != "avx512f") {
    info.native_float_width = std::min(info.native_float_width, isa == "sse" ? 4 : 8);
  }
}

bool IsPoclCpu(const DeviceInfo& info) {
  return info.is_cpu && absl::StrContains(info.platform_name, "Portable Computing Language");
}

bool HostRunsBf16Dot(const DeviceInfo& info) {
#if defined(__x86_64__)
  return IsPoclCpu(info) && __builtin_cpu_supports("avx512bf16");
#else
  (void)info;
  return false;
#endif
}

bool HostGrantsAmxTiles(std::string* why) {
#if defined(__x86_64__) && defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || ((d >> 22) & 1) == 0 ||
      ((d >> 24) & 1) == 0) {
    *why = "the CPU has no AMX-BF16";
    return false;
  }
  // Process-wide and idempotent; asked once.
  static const long granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 0L : long{errno};
  }();
  if (granted != 0) {
    *why = absl::StrCat("the kernel refused the tile state (arch_prctl: ",
                        std::strerror(static_cast<int>(granted)), ")");
    return false;
  }
  return true;
#else
  *why = "not an x86-64 Linux host";
  return false;
#endif
}

bool HostRunsAmx(const DeviceInfo& info, std::string* why) {
  if (!HostRunsBf16Dot(info)) {
    *why = "no BF16 dot-product kernels on this device";
    return false;
  }
  return HostGrantsAmxTiles(why);
}

namespace {

// One tile product as the FFN kernels spell it (kernels/cl/expert_ffn.cl, AmxSums).
constexpr char kAmxProbe[] = R"CL(
__attribute__((target("amx-tile,amx-bf16"))) void Tiles(ulong cfg, ulong a, ulong c) {
  __asm__ volatile("ldtilecfg (%0)\n\ttilezero %%tmm0" ::"r"(cfg) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm2\n\ttileloadd 64(%0,%1,1), %%tmm3\n\t"
                   "tdpbf16ps %%tmm3, %%tmm2, %%tmm0" ::"r"(a), "r"((ulong)128) : "memory");
  __asm__ volatile("tilestored %%tmm0, (%0,%1,1)\n\ttilerelease" ::"r"(c), "r"((ulong)64)
                   : "memory");
}
__kernel void amx_probe(__global const uchar* cfg, __global const uint* a, __global float* c) {
  Tiles((ulong)cfg, (ulong)a, (ulong)c);
}
)CL";

// The dot-product kernels' vdpbf16ps in each form (kernels/cl/expert_ffn.cl, Dpbf16).
constexpr char kDotBuiltinProbe[] = R"(
__attribute__((target("avx512bf16"))) float16 Dot(float16 acc, int16 a, int16 b) {
  return __builtin_ia32_dpbf16ps_512(acc, a, b);
}
__kernel void dot_probe(__global float16* acc, __global const int16* ab) {
  acc[0] = Dot(acc[0], ab[0], ab[1]);
}
)";
constexpr char kDotAsmProbe[] = R"(
__attribute__((target("avx512bf16"))) float16 Dot(float16 acc, int16 a, int16 b) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
__kernel void dot_probe(__global float16* acc, __global const int16* ab) {
  acc[0] = Dot(acc[0], ab[0], ab[1]);
}
)";

// Whether `source` builds for `device`; if not and `why` is given, the log's first line.
bool ProbeBuilds(cl_context context, cl_device_id device, const char* source, std::string* why) {
  cl_int err = CL_SUCCESS;
  cl_program program = clCreateProgramWithSource(context, 1, &source, nullptr, &err);
  if (err != CL_SUCCESS) return false;
  const bool built =
      clBuildProgram(program, 1, &device, "-cl-std=CL1.2", nullptr, nullptr) == CL_SUCCESS;
  if (!built && why != nullptr) {
    const std::string log = BuildLog(program, device);
    *why = log.substr(0, std::min(log.find('\n'), size_t{300}));
  }
  clReleaseProgram(program);
  return built;
}

}  // namespace

std::string BuildLog(cl_program program, cl_device_id device) {
  size_t bytes = 0;
  std::string log;
  if (clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &bytes) ==
      CL_SUCCESS) {
    log.resize(bytes);
    clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, bytes, log.data(), nullptr);
    while (!log.empty() && log.back() == '\0') log.pop_back();
  }
  return log;
}

bool ProbeAmxBuilds(cl_context context, cl_device_id device, std::string* why) {
  return ProbeBuilds(context, device, kAmxProbe, why);
}

DotForm ProbeDotForm(cl_context context, cl_device_id device, bool inline_asm_only,
                     std::string* why) {
  if (!inline_asm_only && ProbeBuilds(context, device, kDotBuiltinProbe, why)) {
    return DotForm::kBuiltin;
  }
  if (ProbeBuilds(context, device, kDotAsmProbe, inline_asm_only ? why : nullptr)) {
    return DotForm::kInlineAsm;
  }
  return DotForm::kNone;
}

}  // namespace detail
}  // namespace epserve::kernels
