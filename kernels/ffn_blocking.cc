#include "kernels/ffn_blocking.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/runtime.h"

namespace epserve::kernels {
namespace {

struct Key {
  const char* name;
  int FfnBlocking::*field;
  int min;
  int max;
};
constexpr Key kKeys[] = {{"vec", &FfnBlocking::vec, 8, 16},
                         {"rows", &FfnBlocking::rows, 2, 16},
                         {"prefetch", &FfnBlocking::prefetch_steps, 0, 1024},
                         {"chunk", &FfnBlocking::row_chunk, 2, 4096}};

FfnBlocking Make(int vec, int rows, int prefetch_steps, int row_chunk) {
  FfnBlocking b;
  b.vec = vec;
  b.rows = rows;
  b.prefetch_steps = prefetch_steps;
  b.row_chunk = row_chunk;
  return b;
}

}  // namespace

std::string FfnBlocking::ToString() const {
  if (dot) return "dot";
  return absl::StrCat("vec=", vec, " rows=", rows, " prefetch=", prefetch_steps,
                      " chunk=", row_chunk);
}

absl::StatusOr<FfnBlocking> ParseFfnBlocking(absl::string_view text) {
  FfnBlocking b;
  if (absl::StripAsciiWhitespace(text) == "dot") return DotKernels();
  for (absl::string_view item : absl::StrSplit(text, absl::ByAnyChar(" ,"), absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    const Key* key = nullptr;
    for (const Key& k : kKeys) {
      if (kv.first == k.name) key = &k;
    }
    if (key == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FFN blocking: unknown key '", kv.first.substr(0, 64),
          "' (keys: vec, rows, prefetch, chunk, e.g. 'vec=8 rows=6'; or 'dot' alone)"));
    }
    int value = 0;
    if (!absl::SimpleAtoi(kv.second, &value) || value < key->min || value > key->max) {
      return absl::InvalidArgumentError(
          absl::StrCat("FFN blocking: ", key->name, " must be an integer in [", key->min, ", ",
                       key->max, "], got '", kv.second.substr(0, 64), "'"));
    }
    b.*(key->field) = value;
  }
  if (b.vec != 8 && b.vec != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("FFN blocking: vec must be 8 or 16, got ", b.vec));
  }
  if (b.row_chunk < b.rows) {
    return absl::InvalidArgumentError(absl::StrCat("FFN blocking: chunk (", b.row_chunk,
                                                   ") must be at least rows (", b.rows, ")"));
  }
  return b;
}

const char* FfnBlockingOriginName(FfnBlockingOrigin origin) {
  switch (origin) {
    case FfnBlockingOrigin::kDefault:
      return "default";
    case FfnBlockingOrigin::kForced:
      return "forced";
    case FfnBlockingOrigin::kCache:
      return "cache";
    case FfnBlockingOrigin::kTuned:
      return "tuned now";
  }
  return "?";
}

std::vector<FfnBlocking> FfnBlockingCandidates(const DeviceInfo& device) {
  // A register block of `rows` x 2 accumulator vectors, plus two panel vectors and one
  // broadcast, must fit the vector registers. Devices of 16 FP32 lanes (AVX-512) have 32 of
  // them: 12 rows of 16-lane sums. Devices of 8 lanes (AVX2: 16 registers; NEON has 32 of 4
  // lanes, i.e. 16 of 8) hold 6 rows of 8-lane sums.
  if (!device.is_cpu) return {FfnBlocking()};
  if (device.native_float_width >= 16) {
    return {Make(16, 12, 64, 192), Make(16, 12, 0, 192), Make(16, 8, 64, 192)};
  }
  // Software prefetch helps some hosts' few-row case and hurts others' (a plain read stream
  // ran at 70% of its speed with it on one AVX2 VM), so its distance is timed too.
  // Each candidate costs a program build on a cold start (about 2 s per variant with PoCL on
  // a 2-core host), so the list stays short.
  return {Make(8, 6, 64, 96), Make(8, 6, 0, 96), Make(8, 4, 64, 192)};
}

FfnBlocking DotKernels() {
  FfnBlocking b;
  b.dot = true;
  return b;
}

std::vector<FfnBlocking> AllFfnBlockingCandidates() {
  std::vector<FfnBlocking> all;
  DeviceInfo info;
  info.is_cpu = true;
  for (int width : {8, 16}) {
    info.native_float_width = width;
    for (const FfnBlocking& b : FfnBlockingCandidates(info)) {
      if (std::find(all.begin(), all.end(), b) == all.end()) all.push_back(b);
    }
  }
  if (std::find(all.begin(), all.end(), FfnBlocking()) == all.end()) all.push_back(FfnBlocking());
  return all;
}

}  // namespace epserve::kernels
