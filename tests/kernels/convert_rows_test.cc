// WidenToFp32 / NarrowFromFp32 (the rows of requests in clients' CUDA memory, converted on the
// device) against the host's conversions (common/convert.h), bit for bit, on fresh random
// values with the edge cases mixed in: zeros, subnormals, the largest values, infinities, NaN.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common/convert.h"
#include "kernels/moe_kernels.h"
#include "tests/kernels/kernel_fixture.h"

namespace epserve::kernels {
namespace {

using common::ElementType;

class ConvertRowsTest : public Seeded {
 protected:
  // Random FP32 values of every magnitude FP16 and BF16 meet, with the edge cases.
  std::vector<float> Values(size_t count) {
    std::vector<float> v = Uniform(count, -2.0f, 2.0f);
    std::uniform_int_distribution<int> exp(-30, 20);
    for (float& x : v) x = std::ldexp(x, exp(rng_));
    const float edges[] = {0.0f,
                           -0.0f,
                           65504.0f,
                           65520.0f,
                           1e-8f,
                           -6e-8f,
                           3e-5f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           3.0e38f};
    for (size_t i = 0; i < std::size(edges) && i < v.size(); ++i) v[i * 7 % v.size()] = edges[i];
    return v;
  }
};

TEST_F(ConvertRowsTest, NarrowAndWidenMatchTheHostBitForBit) {
  for (ElementType type : {ElementType::kFp32, ElementType::kBf16, ElementType::kFp16}) {
    SCOPED_TRACE(common::FlagName(type));
    const size_t count = 3 * 1000 + 17, at = 123, src_at = 41;
    const size_t width = common::ElementBytes(type);
    const std::vector<float> v = Values(count + src_at);
    // Narrow: values [src_at, src_at + count) into the typed buffer from element `at`.
    Buffer typed = Upload(std::vector<uint8_t>((count + at) * width, 0xAB));
    ASSERT_TRUE(NarrowFromFp32(R(), Upload(v), src_at, count, type, typed, at).ok());
    const std::vector<uint8_t> got = Download<uint8_t>(typed, (count + at) * width);
    std::vector<uint8_t> want((count + at) * width, 0xAB);
    common::FromFp32(type, v.data() + src_at, reinterpret_cast<char*>(want.data()) + at * width,
                     count);
    ASSERT_EQ(got, want);
    // Widen them back, into poisoned FP32 rows from element 5.
    Buffer wide = Poisoned(count + 5);
    ASSERT_TRUE(WidenToFp32(R(), typed, at, type, count, wide, 5).ok());
    const std::vector<float> back = Download<float>(wide, count + 5);
    std::vector<float> expect(count);
    common::ToFp32(type, reinterpret_cast<const char*>(want.data()) + at * width, expect.data(),
                   count);
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(back[5 + i]), std::bit_cast<uint32_t>(expect[i])) << i;
    }
    EXPECT_TRUE(std::isnan(back[0]) && std::isnan(back[4])) << "values before dst_at written";
  }
}

TEST_F(ConvertRowsTest, BadArgumentsAreRefused) {
  Buffer f = Poisoned(16);
  EXPECT_EQ(WidenToFp32(R(), f, 0, ElementType::kFp8E4m3, 4, f, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NarrowFromFp32(R(), f, -1, 4, ElementType::kBf16, f, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(WidenToFp32(R(), f, 0, ElementType::kFp32, 32, f, 0).ok());  // past the end
}

}  // namespace
}  // namespace epserve::kernels
