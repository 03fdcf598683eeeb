#include "common/element_type.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace epserve::common {

namespace {

struct ElementTypeRow {
  ElementType type;
  absl::string_view kserve_name;  // "" where KServe v2 has none
  absl::string_view flag_name;
  size_t bytes;
};

// The one name table; a row per enumerator, in enum order.
constexpr ElementTypeRow kElementTypes[] = {
    {ElementType::kFp32, "FP32", "fp32", 4},
    {ElementType::kBf16, "BF16", "bf16", 2},
    {ElementType::kFp16, "FP16", "fp16", 2},
    {ElementType::kFp8E4m3, "", "fp8", 1},
};
static_assert(std::size(kElementTypes) == std::size(kAllElementTypes));

constexpr bool TableInEnumOrder() {
  for (size_t i = 0; i < std::size(kElementTypes); ++i) {
    if (kElementTypes[i].type != kAllElementTypes[i] ||
        static_cast<size_t>(kAllElementTypes[i]) != i)
      return false;
  }
  return true;
}
static_assert(TableInEnumOrder());

// The row of `type`; nullptr for a value outside the enum.
const ElementTypeRow* RowOf(ElementType type) {
  const size_t i = static_cast<size_t>(type);
  return i < std::size(kElementTypes) ? &kElementTypes[i] : nullptr;
}

absl::string_view NameOrInvalid(absl::string_view name) {
  return name.empty() ? absl::string_view(kInvalidElementTypeName) : name;
}

// "a", "a or b", "a, b or c".
std::string JoinNames(absl::Span<const ElementType> types,
                      absl::string_view (*name_of)(ElementType)) {
  std::string out;
  for (size_t i = 0; i < types.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == types.size() ? " or " : ", ");
    absl::StrAppend(&out, name_of(types[i]));
  }
  return out;
}

absl::StatusOr<ElementType> Parse(absl::string_view name, absl::string_view what,
                                  absl::Span<const ElementType> allowed,
                                  absl::string_view (*name_of)(ElementType)) {
  if (name != kInvalidElementTypeName) {
    for (ElementType type : allowed) {
      if (name_of(type) == name) return type;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must be ", JoinNames(allowed, name_of), ", got '", name, "'"));
}

}  // namespace

absl::string_view KServeName(ElementType type) {
  const ElementTypeRow* row = RowOf(type);
  return row != nullptr ? NameOrInvalid(row->kserve_name) : kInvalidElementTypeName;
}

absl::string_view FlagName(ElementType type) {
  const ElementTypeRow* row = RowOf(type);
  return row != nullptr ? row->flag_name : kInvalidElementTypeName;
}

size_t ElementBytes(ElementType type) {
  const ElementTypeRow* row = RowOf(type);
  return row != nullptr ? row->bytes : 0;
}

std::string KServeNames(absl::Span<const ElementType> types) {
  return JoinNames(types, KServeName);
}

std::string FlagNames(absl::Span<const ElementType> types) { return JoinNames(types, FlagName); }

absl::StatusOr<ElementType> ParseKServeName(absl::string_view name, absl::string_view what,
                                            absl::Span<const ElementType> allowed) {
  return Parse(name, what, allowed, KServeName);
}

absl::StatusOr<ElementType> ParseFlagName(absl::string_view name, absl::string_view what,
                                          absl::Span<const ElementType> allowed) {
  return Parse(name, what, allowed, FlagName);
}

absl::Status CheckElementType(ElementType type, absl::string_view what,
                              absl::Span<const ElementType> allowed) {
  if (std::find(allowed.begin(), allowed.end(), type) != allowed.end()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must be ", FlagNames(allowed), ", got '", FlagName(type), "'"));
}

}  // namespace epserve::common
