#include "kernels/dtype.h"

#include "absl/strings/str_cat.h"

namespace epserve::kernels {

absl::StatusOr<DType> ParseDType(absl::string_view name, absl::string_view what) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  return absl::InvalidArgumentError(absl::StrCat(what, " must be fp32 or bf16, got '", name, "'"));
}

const char* DTypeName(DType type) { return type == DType::kBf16 ? "bf16" : "fp32"; }

}  // namespace epserve::kernels
