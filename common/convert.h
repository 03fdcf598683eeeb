// Rows of a client's element type (FP32, BF16, FP16) to and from the FP32 rows the workers
// compute on, and copies that convert on the way, spread over threads: how rank 0 moves a
// request's rows into the heap and its answer out of it. Conversions round to nearest even;
// NaN stays NaN. Thread-safe: plain functions of their arguments.
#pragma once

#include <cstddef>
#include <span>

#include "common/element_type.h"

namespace epserve::common {

// `count` elements of `type` (FP32, BF16 or FP16) at `src` (little-endian, maybe unaligned)
// to FP32 at `dst`.
void ToFp32(ElementType type, const char* src, float* dst, size_t count);
// `count` FP32 values at `src` to `type` (FP32, BF16 or FP16) at `dst` (maybe unaligned).
void FromFp32(ElementType type, const float* src, char* dst, size_t count);

// A copy of `count` elements from `src`, of src_type, to `dst`, of dst_type: the same type
// (a plain copy), or FP32 on one side and FP32, BF16 or FP16 on the other.
struct ConvertJob {
  void* dst;
  ElementType dst_type;
  const void* src;
  ElementType src_type;
  size_t count;
};
// Runs one job on this thread.
void Convert(const ConvertJob& job);
// The jobs of `jobs` (non-overlapping), their elements split evenly over up to `threads`
// threads (common::ParallelFor), at least 256 Ki elements each.
void ParallelConvert(int threads, std::span<const ConvertJob> jobs);

}  // namespace epserve::common
