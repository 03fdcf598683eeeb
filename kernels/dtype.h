// Element types of weights and activations on the device. Whatever the element type, the
// kernels accumulate in FP32. Pure functions, thread-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epserve::kernels {

enum class DType { kFp32, kBf16 };

// "fp32", "bf16"; INVALID_ARGUMENT naming `what` (e.g. "--weight-dtype") otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name, absl::string_view what);
const char* DTypeName(DType type);
inline size_t DTypeBytes(DType type) { return type == DType::kBf16 ? 2 : 4; }

// FP32 -> BF16 rounded to nearest, ties to even; NaN stays NaN (quiet), infinities stay
// infinite, finite values past the largest BF16 round to infinity.
inline uint16_t FloatToBf16(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
// Exact.
inline float Bf16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}
// x rounded to the nearest BF16 value, as FP32.
inline float RoundToBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

}  // namespace epserve::kernels
