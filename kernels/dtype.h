// Element types of weights and activation rows on the device: common::ElementType's FP32 and
// BF16 (kKernelTypes); the entry points refuse the others (CheckKernelType). Whatever the
// element type, the kernels accumulate in FP32. Pure functions, thread-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/element_type.h"
#include "common/half.h"

namespace epserve::kernels {

// The element types the kernels take, for weights (--weight-dtype) and activation rows.
inline constexpr common::ElementType kKernelTypes[] = {common::ElementType::kFp32,
                                                       common::ElementType::kBf16};

// OK for a type of kKernelTypes; else INVALID_ARGUMENT "<what> must be fp32 or bf16, got '...'".
inline absl::Status CheckKernelType(common::ElementType type, absl::string_view what) {
  return common::CheckElementType(type, what, kKernelTypes);
}

// FP32 <-> BF16 (common/half.h).
using common::Bf16ToFloat;
using common::FloatToBf16;
// x rounded to the nearest BF16 value, as FP32.
inline float RoundToBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

}  // namespace epserve::kernels
