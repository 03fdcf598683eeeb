#include "server/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>

namespace epserve::server {

std::optional<ElementType> ParseElementType(absl::string_view datatype) {
  if (datatype == "FP32") return ElementType::kFp32;
  if (datatype == "BF16") return ElementType::kBf16;
  if (datatype == "FP16") return ElementType::kFp16;
  return std::nullopt;
}

const char* ElementTypeName(ElementType type) {
  switch (type) {
    case ElementType::kFp32:
      return "FP32";
    case ElementType::kBf16:
      return "BF16";
    case ElementType::kFp16:
      return "FP16";
  }
  return "?";
}

void ToFp32(ElementType type, const char* src, float* dst, size_t count) {
  if (type == ElementType::kFp32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    dst[i] = type == ElementType::kBf16 ? common::Bf16ToFloat(bits) : common::Fp16ToFloat(bits);
  }
}

void FromFp32(ElementType type, const float* src, char* dst, size_t count) {
  if (type == ElementType::kFp32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    const uint16_t bits =
        type == ElementType::kBf16 ? common::FloatToBf16(src[i]) : common::FloatToFp16(src[i]);
    std::memcpy(dst + 2 * i, &bits, 2);
  }
}

}  // namespace epserve::server
