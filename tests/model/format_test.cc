// The JSON reader and the half-precision conversions behind the checkpoint loader.
#include <cmath>
#include <cstring>

#include "gtest/gtest.h"
#include "model/detail/json.h"
#include "model/detail/safetensors.h"

namespace epserve::model::detail {
namespace {

TEST(Json, ReadsWhatConfigFilesHold) {
  absl::StatusOr<Json> j = ParseJson(R"( {"a": 1, "b": -2.5e-1, "c": [true, false, null],
      "d": {"e": "x\"\u00e9\ud83d\ude00"}, "big": 9007199254740993, "f": 2.0, "n": NaN,
      "inf": -Infinity} )");
  ASSERT_TRUE(j.ok()) << j.status();
  ASSERT_TRUE(j->is_object());
  EXPECT_TRUE(j->Find("a")->is_integer());
  EXPECT_EQ(j->Find("a")->integer(), 1);
  EXPECT_DOUBLE_EQ(j->Find("b")->number(), -0.25);
  EXPECT_FALSE(j->Find("b")->is_integer());
  EXPECT_FALSE(j->Find("f")->is_integer());                  // 2.0 is written as a float
  EXPECT_EQ(j->Find("big")->integer(), 9007199254740993LL);  // exact past 2^53
  EXPECT_EQ(j->Find("c")->array().size(), 3u);
  EXPECT_TRUE(j->Find("c")->array()[2].is_null());
  EXPECT_EQ(j->Find("d")->Find("e")->string(), "x\"\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(std::isnan(j->Find("n")->number()));
  EXPECT_EQ(j->Find("inf")->number(), -INFINITY);
  EXPECT_EQ(j->Find("missing"), nullptr);
}

TEST(Json, IsStrict) {
  for (const char* bad :
       {"", "{", "{\"a\":1,}", "[1,]", "{\"a\":1,\"a\":2}", "01", "1.", "-", "\"\\x\"",
        "\"\\ud800\"", "{} x", "{'a':1}", "[1 2]", "tru", "\"a\nb\""}) {
    EXPECT_FALSE(ParseJson(bad).ok()) << bad;
  }
  std::string deep(100, '[');
  deep += std::string(100, ']');
  EXPECT_FALSE(ParseJson(deep).ok());
  absl::StatusOr<Json> j = ParseJson("{\"a\": 1,  \"a\": 2}");
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("duplicate key \"a\""), std::string::npos);
}

TEST(HalfPrecision, EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float f16 = Fp16ToFloat(bits);
    const float bf16 = Bf16ToFloat(bits);
    if (std::isnan(f16)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f16)))) << b;
    } else {
      ASSERT_EQ(FloatToFp16(f16), bits) << b;
    }
    if (std::isnan(bf16)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(bf16)))) << b;
    } else {
      ASSERT_EQ(FloatToBf16(bf16), bits) << b;
    }
  }
  EXPECT_EQ(Fp16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(Fp16ToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(Bf16ToFloat(0xC040), -3.0f);
}

TEST(HalfPrecision, RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between the F16 neighbours 1 and 1 + 2^-10: ties to even (1).
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7C00);               // rounds past the largest finite
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);  // tie with zero: even
  EXPECT_EQ(FloatToFp16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
}

}  // namespace
}  // namespace epserve::model::detail
