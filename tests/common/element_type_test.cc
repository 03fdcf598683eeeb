#include "common/element_type.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace epserve::common {
namespace {

using ET = ElementType;

TEST(ElementTypeTest, NamesAndSizes) {
  EXPECT_EQ(KServeName(ET::kFp32), "FP32");
  EXPECT_EQ(KServeName(ET::kBf16), "BF16");
  EXPECT_EQ(KServeName(ET::kFp16), "FP16");
  EXPECT_EQ(KServeName(ET::kFp8E4m3), kInvalidElementTypeName);  // KServe v2 has no FP8
  EXPECT_EQ(FlagName(ET::kFp32), "fp32");
  EXPECT_EQ(FlagName(ET::kBf16), "bf16");
  EXPECT_EQ(FlagName(ET::kFp16), "fp16");
  EXPECT_EQ(FlagName(ET::kFp8E4m3), "fp8");
  EXPECT_EQ(ElementBytes(ET::kFp32), 4u);
  EXPECT_EQ(ElementBytes(ET::kBf16), 2u);
  EXPECT_EQ(ElementBytes(ET::kFp16), 2u);
  EXPECT_EQ(ElementBytes(ET::kFp8E4m3), 1u);
}

TEST(ElementTypeTest, ValueOutsideTheEnumReadsAsNoType) {
  const auto bad = static_cast<ET>(200);
  EXPECT_EQ(KServeName(bad), kInvalidElementTypeName);  // not "FP32"
  EXPECT_EQ(FlagName(bad), kInvalidElementTypeName);
  EXPECT_EQ(ElementBytes(bad), 0u);
  absl::Status s = CheckElementType(bad, "--weight-dtype", {ET::kFp32, ET::kBf16});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--weight-dtype must be fp32 or bf16, got '<invalid>'");
}

TEST(ElementTypeTest, ParsesEverySpellingOfItsTable) {
  for (ET type : kAllElementTypes) {
    EXPECT_EQ(*ParseFlagName(FlagName(type), "x", kAllElementTypes), type);
    if (KServeName(type) != kInvalidElementTypeName) {
      EXPECT_EQ(*ParseKServeName(KServeName(type), "x", kAllElementTypes), type);
    }
  }
}

TEST(ElementTypeTest, ParseNamesTheBadValueAndTheAllowedOnes) {
  absl::StatusOr<ET> t =
      ParseFlagName("fp16", "--dispatch-dtype", {ET::kFp32, ET::kBf16, ET::kFp8E4m3});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.status().message(), "--dispatch-dtype must be fp32, bf16 or fp8, got 'fp16'");
  t = ParseKServeName("INT8", "input 'x' datatype", {ET::kFp32, ET::kBf16, ET::kFp16});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "input 'x' datatype must be FP32, BF16 or FP16, got 'INT8'");
  // Exact spellings only: a flag takes lower case, KServe upper case.
  EXPECT_FALSE(ParseFlagName("FP32", "x", kAllElementTypes).ok());
  EXPECT_FALSE(ParseKServeName("fp32", "x", kAllElementTypes).ok());
  // The name of "no KServe datatype" is no datatype.
  EXPECT_FALSE(ParseKServeName(kInvalidElementTypeName, "x", kAllElementTypes).ok());
  EXPECT_FALSE(ParseKServeName("", "x", kAllElementTypes).ok());
}

TEST(ElementTypeTest, NameLists) {
  EXPECT_EQ(FlagNames({ET::kFp32}), "fp32");
  EXPECT_EQ(FlagNames({ET::kFp32, ET::kBf16}), "fp32 or bf16");
  EXPECT_EQ(KServeNames({ET::kFp32, ET::kBf16, ET::kFp16}), "FP32, BF16 or FP16");
  EXPECT_TRUE(CheckElementType(ET::kBf16, "w", {ET::kFp32, ET::kBf16}).ok());
  EXPECT_EQ(CheckElementType(ET::kFp16, "w", {ET::kFp32, ET::kBf16}).message(),
            "w must be fp32 or bf16, got 'fp16'");
}

}  // namespace
}  // namespace epserve::common
