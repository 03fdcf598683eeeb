// Element types a client may send or ask for, and their conversion to and from the FP32
// rows the workers compute on. Conversions round to nearest even; NaN stays NaN.
// Thread-safe: plain functions of their arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"
#include "common/half.h"

namespace epserve::server {

enum class ElementType : uint8_t { kFp32, kBf16, kFp16 };

// "FP32", "BF16", "FP16" (the KServe v2 datatype strings); nullopt for anything else.
std::optional<ElementType> ParseElementType(absl::string_view datatype);
const char* ElementTypeName(ElementType type);
inline size_t ElementBytes(ElementType type) { return type == ElementType::kFp32 ? 4 : 2; }

// `count` elements of `type` at `src` (little-endian, maybe unaligned) to FP32 at `dst`.
void ToFp32(ElementType type, const char* src, float* dst, size_t count);
// `count` FP32 values at `src` to `type` at `dst` (maybe unaligned).
void FromFp32(ElementType type, const float* src, char* dst, size_t count);

}  // namespace epserve::server
