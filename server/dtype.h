// The element types a client may send or ask for (kRequestTypes, by their KServe v2 datatype
// strings; common/element_type.h), and their conversion to and from the FP32 rows the workers
// compute on. Conversions round to nearest even; NaN stays NaN.
// Thread-safe: plain functions of their arguments.
#pragma once

#include <cstddef>

#include "common/element_type.h"

namespace epserve::server {

// FP32, BF16, FP16: the datatypes of input hidden_states and output moe_output.
inline constexpr common::ElementType kRequestTypes[] = {
    common::ElementType::kFp32, common::ElementType::kBf16, common::ElementType::kFp16};

// `count` elements of `type` (one of kRequestTypes) at `src` (little-endian, maybe unaligned)
// to FP32 at `dst`.
void ToFp32(common::ElementType type, const char* src, float* dst, size_t count);
// `count` FP32 values at `src` to `type` (one of kRequestTypes) at `dst` (maybe unaligned).
void FromFp32(common::ElementType type, const float* src, char* dst, size_t count);

}  // namespace epserve::server
