// Finding and choosing the OpenCL device of a Runtime, and probing what its compiler builds
// for. Private to kernels/ (the public side is DeviceInfo and ListDevices in runtime.h).
#pragma once

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/runtime.h"

namespace epserve::kernels::detail {

// One device and what DeviceInfo says of it (target_isa not yet probed).
struct FoundDevice {
  cl_device_id id = nullptr;
  DeviceInfo info;
};

// Every device of every platform, in platform then device order; empty (not an error) where
// no OpenCL platform or device is installed.
absl::StatusOr<std::vector<FoundDevice>> EnumerateDevices();

// The device `spec` names among `devices`: "cpu" (the first CPU), "gpu" (local_rank picks
// among the GPUs, in turn) or "<platform>:<device>" indices. Errors (NOT_FOUND, or
// INVALID_ARGUMENT for a malformed spec) list the devices found.
absl::StatusOr<FoundDevice> ChooseDevice(const std::vector<FoundDevice>& devices,
                                         absl::string_view spec, int local_rank);

// On a CPU device, sets info.target_isa and info.clang_major from the predefined macros of the
// device's compiler (a one-work-item kernel run on `queue`) and caps info.native_float_width to
// what that target has (8 without AVX-512, 4 with SSE only). Other devices, or a probe that cannot
// run, leave `info` as it is: the probe's errors are not the caller's.
void ProbeCpuTarget(cl_context context, cl_device_id device, cl_command_queue queue,
                    DeviceInfo& info);

// Whether the device is a CPU device of PoCL (the Portable Computing Language), which compiles
// kernels for the host's CPU with its own LLVM.
bool IsPoclCpu(const DeviceInfo& info);

// Whether the BF16 dot-product kernels (clang's x86 builtin for vdpbf16ps) can run on the
// device: a CPU device of PoCL, which compiles for the host, on a host that has AVX512-BF16.
bool HostRunsBf16Dot(const DeviceInfo& info);

// Whether this process may run AMX tile instructions: the CPU has AMX-TILE and AMX-BF16
// (cpuid) and Linux granted the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked
// once; without it the first tile instruction is a fatal signal). `why` gets the reason where
// it is false.
bool HostGrantsAmxTiles(std::string* why);

// Whether the dot-product kernels may also run on AMX tiles (tdpbf16ps): HostRunsBf16Dot's
// device on a host that HostGrantsAmxTiles.
bool HostRunsAmx(const DeviceInfo& info, std::string* why);

// Whether the device's compiler builds the AMX tile instructions as the FFN kernels spell them
// (inline assembly); `why` gets the build log's first line where it does not.
bool ProbeAmxBuilds(cl_context context, cl_device_id device, std::string* why);

// The build log of `program` for `device`, without trailing NULs ("" if it cannot be read).
std::string BuildLog(cl_program program, cl_device_id device);

// The form in which the device's compiler builds the dot-product kernels' vdpbf16ps (a
// one-function probe of each, in order): clang's builtin with 16-int operands, as clang 15 and
// earlier take it, else one instruction of inline assembly (clang 16 and later changed the
// builtin's operands to 32 __bf16, and PoCL 5 refuses the int form). kNone where neither
// builds; `why` then gets the first failing form's build log's first line. inline_asm_only
// skips the builtin (RuntimeOptions::bf16_dot_inline_asm, and devices whose compiler is clang
// 16 or later, DeviceInfo::clang_major).
DotForm ProbeDotForm(cl_context context, cl_device_id device, bool inline_asm_only,
                     std::string* why);

}  // namespace epserve::kernels::detail
