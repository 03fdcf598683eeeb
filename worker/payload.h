// Row encodings of the exchange payload: the element types of kPayloadTypes
// (common/element_type.h). A row is `hidden` values:
//   fp32  4 bytes per value.
//   bf16  2 bytes per value, rounded to nearest, ties to even (NaN stays NaN).
//   fp8   FP8 E4M3 (OCP "e4m3fn": bias 7, no infinities, max 448) with one FP32 scale per
//         block of 128 values: scales first (ceil(hidden / 128) floats), then one byte per
//         value. scale = max |x| of the block / 448; values saturate at +-448 (so +-inf
//         becomes +-448 * scale), NaN stays NaN.
// Every row size is rounded up to 16 bytes so rows stay aligned. Pure functions,
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/element_type.h"
#include "common/half.h"

namespace epserve::worker {

// fp32, bf16, fp8 (e4m3): the element types a payload row can hold.
inline constexpr common::ElementType kPayloadTypes[] = {
    common::ElementType::kFp32, common::ElementType::kBf16, common::ElementType::kFp8E4m3};
// One of kPayloadTypes by its flag spelling ("fp32", "bf16", "fp8"); INVALID_ARGUMENT
// "--<flag> must be fp32, bf16 or fp8, got '<name>'" otherwise.
absl::StatusOr<common::ElementType> ParsePayloadType(absl::string_view name,
                                                     absl::string_view flag);
// OK for one of kPayloadTypes; INVALID_ARGUMENT naming `what` otherwise. The functions below
// take only these (another type has rows of 0 bytes, and nothing is encoded or decoded).
absl::Status CheckPayloadType(common::ElementType type, absl::string_view what);

inline constexpr int64_t kFp8BlockSize = 128;

// Bytes of one encoded row of `hidden` values (a multiple of 16).
size_t PayloadRowBytes(common::ElementType type, int64_t hidden);

// src [hidden] -> dst [PayloadRowBytes], padding zeroed.
void EncodeRow(common::ElementType type, const float* src, int64_t hidden, void* dst);
// src [PayloadRowBytes] -> dst [hidden].
void DecodeRow(common::ElementType type, const void* src, int64_t hidden, float* dst);
// dst[i] += decoded value i.
void AccumulateRow(common::ElementType type, const void* src, int64_t hidden, float* dst);

// dst = (dst +) parts[0] + parts[1] + ... (decoded), summed left to right in fp32: the same
// values as DecodeRow of the first part (unless `accumulate`) followed by AccumulateRow of
// the others, in one pass over dst.
void SumRows(common::ElementType type, const void* const* parts, int num_parts, int64_t hidden,
             float* dst, bool accumulate);

// dst = (dst +) scale[0] * parts[0] + scale[1] * parts[1] + ... (decoded), left to right in
// fp32, each term a product then a sum (never fused), so the result is a function of the
// parts and scales in their order alone, on every host.
void WeightedSumRows(common::ElementType type, const void* const* parts, const float* scale,
                     int num_parts, int64_t hidden, float* dst, bool accumulate);

// Scalar conversions, exposed for tests (BF16: common/half.h).
using common::Bf16ToFloat;
using common::FloatToBf16;
uint8_t FloatToFp8E4m3(float x);  // saturating, round to nearest even
float Fp8E4m3ToFloat(uint8_t bits);

}  // namespace epserve::worker
