// What a worker does alike for rows in either kind of client memory (worker/cuda_rows.h,
// worker/host_rows.h): a segment's byte count, checked against the batch, and its rows
// between a staging buffer in the request's element type, each segment at its own rows there
// (its bytes fit in their FP32 size), and the worker's FP32 rows, converted on the device as
// rank 0 converts rows in host memory (the same bits).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/runtime.h"
#include "worker/device_rows.h"

namespace epserve::worker {

// The bytes of segment `s` in its own element type; INTERNAL (naming `kind`, "CUDA" or
// "shared-memory") where its rows lie outside the batch's n rows or its type is unknown.
absl::StatusOr<size_t> SegmentBytes(const DeviceRowSegment& s, int64_t n, int64_t hidden,
                                    const char* kind);
// Segment s's rows from `staging` into x [n][hidden] FP32.
absl::Status WidenSegment(kernels::Runtime& rt, const kernels::Buffer& staging,
                          const DeviceRowSegment& s, int64_t hidden, kernels::Buffer& x);
// Segment s's rows of y [n][hidden] FP32 into `staging`.
absl::Status NarrowSegment(kernels::Runtime& rt, const kernels::Buffer& y,
                           const DeviceRowSegment& s, int64_t hidden, kernels::Buffer& staging);

}  // namespace epserve::worker
