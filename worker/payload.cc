#include "worker/payload.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

// The row codecs run over every exchanged value: on x86-64 they are also built for AVX2 and
// the better version is chosen at load time (the default build targets baseline x86-64).
// Not under ThreadSanitizer: the loader runs the version resolvers before the TSan runtime
// is up, and the instrumented resolver crashes the program before main.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define EPSERVE_ROW_CODEC __attribute__((target_clones("avx2", "default")))
#else
#define EPSERVE_ROW_CODEC
#endif

namespace epserve::worker {

using common::ElementType;

absl::StatusOr<ElementType> ParsePayloadType(absl::string_view name, absl::string_view flag) {
  return common::ParseFlagName(name, absl::StrCat("--", flag), kPayloadTypes);
}

absl::Status CheckPayloadType(ElementType type, absl::string_view what) {
  return common::CheckElementType(type, what, kPayloadTypes);
}

namespace {

size_t RoundUp16(size_t bytes) { return (bytes + 15) / 16 * 16; }
int64_t NumBlocks(int64_t hidden) { return (hidden + kFp8BlockSize - 1) / kFp8BlockSize; }

constexpr float kFp8Max = 448.0f;

const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int exp = (b >> 3) & 0xF;
      const int man = b & 0x7;
      float v;
      if (exp == 0xF && man == 0x7) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (exp == 0) {
        v = std::ldexp(static_cast<float>(man), -9);
      } else {
        v = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
      }
      t[b] = (b & 0x80) ? -v : v;
    }
    return t;
  }();
  return table;
}

}  // namespace

uint8_t FloatToFp8E4m3(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;   // NaN
  if (a >= 0x43E00000u) return sign | 0x7E;  // >= 448 (and inf): saturate
  if (a < 0x3C800000u) {
    // Below 2^-6: subnormal, in units of 2^-9, rounded to nearest even (8 = 2^-6 is the
    // smallest normal, whose encoding is 0x08 as well).
    const float q = std::nearbyint(std::bit_cast<float>(a) * 512.0f);
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: keep 3 mantissa bits, rounding to nearest even; a carry moves into the
  // exponent. Re-bias the exponent from 127 to 7.
  const uint32_t rounded = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  const uint32_t code = rounded - ((127u - 7u) << 3);
  return sign | static_cast<uint8_t>(code > 0x7E ? 0x7E : code);
}

float Fp8E4m3ToFloat(uint8_t bits) { return Fp8Table()[bits]; }

namespace {

// Bytes of a row's scales and values, before padding; 0 for a type not of kPayloadTypes.
size_t UsedBytes(ElementType type, int64_t hidden) {
  const size_t h = static_cast<size_t>(hidden);
  switch (type) {
    case ElementType::kFp32:
      return h * sizeof(float);
    case ElementType::kBf16:
      return h * sizeof(uint16_t);
    case ElementType::kFp8E4m3:
      return static_cast<size_t>(NumBlocks(hidden)) * sizeof(float) + h;
    case ElementType::kFp16:  // not a payload type
      break;
  }
  return 0;
}

}  // namespace

size_t PayloadRowBytes(ElementType type, int64_t hidden) {
  return RoundUp16(UsedBytes(type, hidden));
}

EPSERVE_ROW_CODEC void EncodeRow(ElementType type, const float* src, int64_t hidden, void* dst) {
  // Padding is zeroed, so that an encoded row is a function of its values only.
  const size_t used = UsedBytes(type, hidden);
  std::memset(static_cast<char*>(dst) + used, 0, PayloadRowBytes(type, hidden) - used);
  switch (type) {
    case ElementType::kFp32:
      std::memcpy(dst, src, static_cast<size_t>(hidden) * sizeof(float));
      return;
    case ElementType::kBf16: {
      uint16_t* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < hidden; ++i) out[i] = FloatToBf16(src[i]);
      return;
    }
    case ElementType::kFp8E4m3: {
      const int64_t blocks = NumBlocks(hidden);
      float* scales = static_cast<float*>(dst);
      uint8_t* out = static_cast<uint8_t*>(dst) + blocks * sizeof(float);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t begin = blk * kFp8BlockSize;
        const int64_t end = std::min(hidden, begin + kFp8BlockSize);
        float amax = 0.0f;
        for (int64_t i = begin; i < end; ++i) {
          const float a = std::fabs(src[i]);
          if (std::isfinite(a)) amax = std::max(amax, a);
        }
        const float scale = amax > 0.0f ? amax / kFp8Max : 1.0f;
        const float inv = 1.0f / scale;
        scales[blk] = scale;
        for (int64_t i = begin; i < end; ++i) out[i] = FloatToFp8E4m3(src[i] * inv);
      }
      return;
    }
    case ElementType::kFp16:  // not a payload type: a row of 0 bytes
      return;
  }
}

namespace {

// Calls store(i, value) for each of the row's `hidden` decoded values.
template <typename Store>
void ForEachDecoded(ElementType type, const void* src, int64_t hidden, Store&& store) {
  switch (type) {
    case ElementType::kFp32: {
      const float* in = static_cast<const float*>(src);
      for (int64_t i = 0; i < hidden; ++i) store(i, in[i]);
      return;
    }
    case ElementType::kBf16: {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < hidden; ++i) store(i, Bf16ToFloat(in[i]));
      return;
    }
    case ElementType::kFp8E4m3: {
      const int64_t blocks = NumBlocks(hidden);
      const float* scales = static_cast<const float*>(src);
      const uint8_t* in = static_cast<const uint8_t*>(src) + blocks * sizeof(float);
      const std::array<float, 256>& table = Fp8Table();
      for (int64_t i = 0; i < hidden; ++i) store(i, table[in[i]] * scales[i / kFp8BlockSize]);
      return;
    }
    case ElementType::kFp16:  // not a payload type: a row of 0 bytes
      return;
  }
}

}  // namespace

EPSERVE_ROW_CODEC void DecodeRow(ElementType type, const void* src, int64_t hidden, float* dst) {
  if (type == ElementType::kFp32) {
    std::memcpy(dst, src, static_cast<size_t>(hidden) * sizeof(float));
    return;
  }
  ForEachDecoded(type, src, hidden, [dst](int64_t i, float v) { dst[i] = v; });
}

EPSERVE_ROW_CODEC void AccumulateRow(ElementType type, const void* src, int64_t hidden,
                                     float* dst) {
  ForEachDecoded(type, src, hidden, [dst](int64_t i, float v) { dst[i] += v; });
}

EPSERVE_ROW_CODEC void SumRows(ElementType type, const void* const* parts, int num_parts,
                               int64_t hidden, float* dst, bool accumulate) {
  // Whole-row passes into dst (a row stays in L1), each a plain loop the compiler vectorizes:
  // the first part decoded (unless accumulating), then each further part added, in order.
  int m = 0;
  if (!accumulate) {
    if (num_parts == 0) {
      std::fill(dst, dst + hidden, 0.0f);
      return;
    }
    ForEachDecoded(type, parts[0], hidden, [dst](int64_t i, float v) { dst[i] = v; });
    m = 1;
  }
  for (; m < num_parts; ++m) {
    ForEachDecoded(type, parts[m], hidden, [dst](int64_t i, float v) { dst[i] += v; });
  }
}

EPSERVE_ROW_CODEC void WeightedSumRows(ElementType type, const void* const* parts,
                                       const float* scale, int num_parts, int64_t hidden,
                                       float* dst, bool accumulate) {
  if (!accumulate) std::fill(dst, dst + hidden, 0.0f);
  for (int m = 0; m < num_parts; ++m) {
    const float s = scale[m];
    ForEachDecoded(type, parts[m], hidden, [dst, s](int64_t i, float v) {
      const float product = s * v;
      dst[i] += product;
    });
  }
}

}  // namespace epserve::worker
