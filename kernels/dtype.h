// Element types of weights and activations on the device. Whatever the element type, the
// kernels accumulate in FP32. Pure functions, thread-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/half.h"

namespace epserve::kernels {

enum class DType { kFp32, kBf16 };

// "fp32", "bf16"; INVALID_ARGUMENT naming `what` (e.g. "--weight-dtype") otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name, absl::string_view what);
const char* DTypeName(DType type);
inline size_t DTypeBytes(DType type) { return type == DType::kBf16 ? 2 : 4; }

// FP32 <-> BF16 (common/half.h).
using common::Bf16ToFloat;
using common::FloatToBf16;
// x rounded to the nearest BF16 value, as FP32.
inline float RoundToBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

}  // namespace epserve::kernels
