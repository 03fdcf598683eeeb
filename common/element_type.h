// The element types of epserve's tensors (a client's inputs and outputs, expert weights, the
// rows the workers exchange) and their one name table: each type's KServe v2 datatype string,
// its lower-case spelling in flags, and the bytes of one element. A folder that takes only some
// of them (the front-end and client: FP32, BF16, FP16; the kernels: fp32, bf16; the exchange
// payload: fp32, bf16, fp8) lists its subset at its edge and checks values there with the
// functions below. Pure functions of constant data, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace epserve::common {

enum class ElementType : uint8_t {
  kFp32,
  kBf16,     // the upper half of an FP32 (common/half.h)
  kFp16,     // IEEE binary16 (common/half.h)
  kFp8E4m3,  // OCP "e4m3fn": bias 7, no infinities, max 448 (worker/payload.h scales it)
};

inline constexpr ElementType kAllElementTypes[] = {ElementType::kFp32, ElementType::kBf16,
                                                   ElementType::kFp16, ElementType::kFp8E4m3};

// What the name functions answer for a value outside the enum, and KServeName for a type that
// KServe v2 has no datatype for (kFp8E4m3); no parse function accepts it.
inline constexpr char kInvalidElementTypeName[] = "<invalid>";

// "FP32", "BF16", "FP16" (KServe v2 datatype strings; FP8 has none: kInvalidElementTypeName).
absl::string_view KServeName(ElementType type);
// "fp32", "bf16", "fp16", "fp8" (the spelling of --weight-dtype, --dispatch-dtype, ...).
absl::string_view FlagName(ElementType type);
// Bytes of one element: 4, 2, 2, 1 (FP8's block scales are the payload's; worker/payload.h);
// 0 for a value outside the enum.
size_t ElementBytes(ElementType type);

// The names of `types` for messages: "FP32, BF16 or FP16", "fp32, bf16 or fp8".
std::string KServeNames(absl::Span<const ElementType> types);
std::string FlagNames(absl::Span<const ElementType> types);

// The type of `allowed` whose KServe name (exact, upper case) or flag spelling is `name`; else
// INVALID_ARGUMENT "<what> must be FP32, BF16 or FP16, got '<name>'" (the names of `allowed`).
absl::StatusOr<ElementType> ParseKServeName(absl::string_view name, absl::string_view what,
                                            absl::Span<const ElementType> allowed);
absl::StatusOr<ElementType> ParseFlagName(absl::string_view name, absl::string_view what,
                                          absl::Span<const ElementType> allowed);

// OK when `type` is one of `allowed`; else INVALID_ARGUMENT "<what> must be fp32 or bf16, got
// 'fp16'" (flag spellings). For a folder's entry points that take an ElementType from code.
absl::Status CheckElementType(ElementType type, absl::string_view what,
                              absl::Span<const ElementType> allowed);

}  // namespace epserve::common
