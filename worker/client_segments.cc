#include "worker/client_segments.h"

#include "absl/strings/str_cat.h"
#include "kernels/moe_kernels.h"

namespace epserve::worker {
namespace {

// A segment's first value in the staging buffer, in elements of its own type.
int64_t StagingAt(const DeviceRowSegment& s, int64_t hidden) {
  return s.first_row * hidden *
         static_cast<int64_t>(sizeof(float) / common::ElementBytes(s.where.type));
}

}  // namespace

absl::StatusOr<size_t> SegmentBytes(const DeviceRowSegment& s, int64_t n, int64_t hidden,
                                    const char* kind) {
  if (s.first_row < 0 || s.rows < 1 || s.first_row + s.rows > n) {
    return absl::InternalError(absl::StrCat("a ", kind, " row segment of rows [", s.first_row, ", ",
                                            s.first_row + s.rows, ") outside the batch's ", n,
                                            " rows"));
  }
  const size_t element = common::ElementBytes(s.where.type);
  if (element == 0 || element > sizeof(float)) {
    return absl::InternalError(absl::StrCat("a ", kind, " row segment of an unknown element type"));
  }
  return static_cast<size_t>(s.rows * hidden) * element;
}

absl::Status WidenSegment(kernels::Runtime& rt, const kernels::Buffer& staging,
                          const DeviceRowSegment& s, int64_t hidden, kernels::Buffer& x) {
  return kernels::WidenToFp32(rt, staging, StagingAt(s, hidden), s.where.type, s.rows * hidden, x,
                              s.first_row * hidden);
}

absl::Status NarrowSegment(kernels::Runtime& rt, const kernels::Buffer& y,
                           const DeviceRowSegment& s, int64_t hidden, kernels::Buffer& staging) {
  return kernels::NarrowFromFp32(rt, y, s.first_row * hidden, s.rows * hidden, s.where.type,
                                 staging, StagingAt(s, hidden));
}

}  // namespace epserve::worker
