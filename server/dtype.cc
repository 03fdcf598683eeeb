#include "server/dtype.h"

#include <cstdint>
#include <cstring>

#include "common/half.h"

namespace epserve::server {

using common::ElementType;

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
