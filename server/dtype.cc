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

uint16_t Fp32ToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16ToFp32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t Fp32ToFp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t abs = bits & 0x7fffffff;
  if (abs >= 0x7f800000) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  }
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds past 65504
  if (abs < 0x38800000) {  // below FP16's smallest normal: a subnormal or zero
    // value * 2^24 is the subnormal's integer mantissa; the FPU rounds to nearest even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits.
  uint32_t h = abs - 0x38000000;
  h += 0xfff + ((h >> 13) & 1);
  return static_cast<uint16_t>(sign | (h >> 13));
}

float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000 | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

void ToFp32(ElementType type, const char* src, float* dst, size_t count) {
  if (type == ElementType::kFp32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    dst[i] = type == ElementType::kBf16 ? Bf16ToFp32(bits) : Fp16ToFp32(bits);
  }
}

void FromFp32(ElementType type, const float* src, char* dst, size_t count) {
  if (type == ElementType::kFp32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    const uint16_t bits = type == ElementType::kBf16 ? Fp32ToBf16(src[i]) : Fp32ToFp16(src[i]);
    std::memcpy(dst + 2 * i, &bits, 2);
  }
}

}  // namespace epserve::server
