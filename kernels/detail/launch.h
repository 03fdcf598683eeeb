// What every kernel launcher shares: typed argument setting, launching, and the checks of
// buffer sizes and integer ranges. Private to kernels/.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/detail/cl_check.h"
#include "kernels/runtime.h"

namespace epserve::kernels::detail {

inline absl::Status SetArg(cl_kernel kernel, cl_uint index, const Buffer& buffer) {
  const cl_mem mem = buffer.mem();  // may be nullptr: the kernel sees a null pointer
  CL_CHECK(clSetKernelArg(kernel, index, sizeof(mem), &mem));
  return absl::OkStatus();
}

// A buffer held as its handle (nullptr: the kernel sees a null pointer).
inline absl::Status SetArg(cl_kernel kernel, cl_uint index, cl_mem mem) {
  CL_CHECK(clSetKernelArg(kernel, index, sizeof(mem), &mem));
  return absl::OkStatus();
}

template <typename T>
absl::Status SetArg(cl_kernel kernel, cl_uint index, const T& value) {
  static_assert(std::is_trivially_copyable_v<T> && !std::is_pointer_v<T>);
  CL_CHECK(clSetKernelArg(kernel, index, sizeof(T), &value));
  return absl::OkStatus();
}

// Sets the arguments of `kernel` in order. Integers must already have the kernel's types
// (cl_int for int, cl_long for long).
template <typename... Args>
absl::Status SetArgs(cl_kernel kernel, const Args&... args) {
  cl_uint index = 0;
  absl::Status status;
  (
      [&] {
        if (status.ok()) status = SetArg(kernel, index, args);
        ++index;
      }(),
      ...);
  return status;
}

inline absl::Status Launch(Runtime& rt, cl_kernel kernel, cl_uint dims, const size_t* global,
                           const size_t* local) {
  cl_event event = nullptr;
  CL_CHECK(clEnqueueNDRangeKernel(rt.launch_queue(), kernel, dims, nullptr, global, local, 0,
                                  nullptr, rt.profiles_commands() ? &event : nullptr));
  if (event != nullptr) rt.RecordCommand(event, kernel);
  return absl::OkStatus();
}

// Launches `kernel` over at least `global` work-items. On CPU devices the work-group size is
// fixed (`cpu_local`, global rounded up to a multiple of it: the kernel must ignore work-items
// past its bounds), because PoCL compiles a kernel anew for every work-group size it picks,
// and it picks one from the global size: batches of new sizes would each pay a compile (tens
// to hundreds of ms) on their first launch. Elsewhere the driver picks the work-group size.
inline absl::Status LaunchBounded(Runtime& rt, cl_kernel kernel, cl_uint dims, const size_t* global,
                                  const size_t* cpu_local) {
  if (!rt.device_info().is_cpu) return Launch(rt, kernel, dims, global, nullptr);
  size_t rounded[3] = {1, 1, 1};
  for (cl_uint d = 0; d < dims; ++d) {
    rounded[d] = (global[d] + cpu_local[d] - 1) / cpu_local[d] * cpu_local[d];
  }
  return Launch(rt, kernel, dims, rounded, cpu_local);
}
// Work-group sizes of the bounded launches on CPU devices: kernels of one work-item per row
// keep groups small (rows are few and each is a long loop), element-wise ones large.
inline constexpr size_t kCpuRowsPerGroup[1] = {4};
inline constexpr size_t kCpuValuesPerGroup[1] = {256};
inline constexpr size_t kCpuCombineGroup[2] = {256, 1};

// Rows of `hidden` values, `stride` values apart, that a buffer of `value_bytes`-byte values
// holds: the last one needs only `hidden` values, not a whole stride.
inline cl_long RowsInBuffer(const Buffer& b, size_t value_bytes, int64_t hidden, int64_t stride) {
  const int64_t values = static_cast<int64_t>(b.bytes() / value_bytes);
  return values < hidden ? 0 : (values - hidden) / stride + 1;
}

inline absl::Status NeedBytes(const Buffer& b, size_t bytes, absl::string_view what) {
  if (b.bytes() < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds ", b.bytes(), " bytes, needs ", bytes));
  }
  return absl::OkStatus();
}

inline absl::Status NeedIntRange(int64_t value, absl::string_view what) {
  if (value < 0 || value > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be in [0, ", INT_MAX, "], got ", value));
  }
  return absl::OkStatus();
}

}  // namespace epserve::kernels::detail
