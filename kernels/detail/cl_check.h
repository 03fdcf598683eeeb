// Error handling for OpenCL calls inside kernels/. Private to kernels/.
//
// CL_CHECK(expr) evaluates `expr` (a cl_int status, or a `(obj = clCreateX(..., &err), err)`
// pair) and, when it is not CL_SUCCESS, returns from the enclosing function an absl::Status
// that names the call, the OpenCL error, the file and the line. It works in functions
// returning absl::Status or absl::StatusOr<T>.
#pragma once

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include "absl/status/status.h"

namespace epserve::kernels::detail {

// "CL_INVALID_VALUE" for -30; "CL_UNKNOWN_ERROR" for codes OpenCL 1.2 does not name.
const char* ClErrorName(cl_int err);

// The status CL_CHECK returns: RESOURCE_EXHAUSTED for allocation failures, INTERNAL
// otherwise; the message reads "<call> failed: <name> (<code>) at <file>:<line>".
absl::Status ClError(cl_int err, const char* call, const char* file, int line);

}  // namespace epserve::kernels::detail

#define CL_CHECK(expr)                                                                      \
  do {                                                                                      \
    const cl_int cl_check_err_ = (expr);                                                    \
    if (cl_check_err_ != CL_SUCCESS)                                                        \
      return ::epserve::kernels::detail::ClError(cl_check_err_, #expr, __FILE__, __LINE__); \
  } while (false)
