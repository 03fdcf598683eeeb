// FP32 <-> BF16 and FP16 bit conversions, shared by every part of epserve that stores or sends
// 16-bit values (kernels, the exchange payload, checkpoints, the gRPC front-end and client).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace epserve::common {

// FP32 -> BF16 rounded to nearest, ties to even; NaN stays NaN (quiet), infinities stay
// infinite, finite values past the largest BF16 round to infinity.
// Branch-free (the NaN case is a select), so that loops over rows of it vectorize.
inline uint16_t FloatToBf16(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x40u;
  return static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

// Exact.
inline float Bf16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// FP32 -> IEEE FP16 rounded to nearest, ties to even (subnormals included); NaN stays NaN
// (quiet), values that round past 65504 become infinite.
inline uint16_t FloatToFp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (abs < 0x38800000u) {  // below FP16's smallest normal: a subnormal or zero
    // value * 2^24 is the subnormal's integer mantissa, exact in float; nearbyint rounds to
    // nearest even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  uint32_t h = abs - 0x38000000u;
  h += 0xFFFu + ((h >> 13) & 1u);
  return static_cast<uint16_t>(sign | (h >> 13));
}

// Exact.
inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

}  // namespace epserve::common
