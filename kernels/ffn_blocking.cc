#include "kernels/ffn_blocking.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/detail/ffn_layout.h"
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

// The pair-panel forms' names, without "-direct".
struct DotName {
  const char* name;
  FfnBlocking::DotOp op;
};
constexpr DotName kDotNames[] = {{"dot", FfnBlocking::DotOp::kDefault},
                                 {"dot-vdp", FfnBlocking::DotOp::kVdp},
                                 {"pair-fma", FfnBlocking::DotOp::kFma}};
constexpr const char* kRowClassNames[kFfnRowClasses] = {"1", "2-8", "9-64", "65+"};
constexpr int64_t kRowClassFirst[kFfnRowClasses] = {1, 2, detail::kDotDirectRows + 1, 65};
constexpr int64_t kRowClassSample[kFfnRowClasses] = {1, detail::kDotDirectRows, 32, 128};
static_assert(detail::kDotDirectRows == 8, "the class names say 2-8");

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
  if (dot) {
    for (const DotName& d : kDotNames) {
      if (d.op == dot_op) return absl::StrCat(d.name, direct ? "-direct" : "");
    }
  }
  return absl::StrCat("vec=", vec, " rows=", rows, " prefetch=", prefetch_steps,
                      " chunk=", row_chunk);
}

absl::StatusOr<FfnBlocking> ParseFfnBlocking(absl::string_view text) {
  FfnBlocking b;
  absl::string_view name = absl::StripAsciiWhitespace(text);
  const bool direct = absl::ConsumeSuffix(&name, "-direct");
  for (const DotName& d : kDotNames) {
    if (name == d.name) return DotKernels(d.op, direct);
  }
  for (absl::string_view item : absl::StrSplit(text, absl::ByAnyChar(" ,"), absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, '=');
    const Key* key = nullptr;
    for (const Key& k : kKeys) {
      if (kv.first == k.name) key = &k;
    }
    if (key == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("FFN blocking: unknown key '", kv.first.substr(0, 64),
                       "' (keys: vec, rows, prefetch, chunk, e.g. 'vec=8 rows=6'; or alone 'dot', "
                       "'dot-vdp' or 'pair-fma', each with '-direct' or not)"));
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

FfnBlocking DotKernels(FfnBlocking::DotOp op, bool direct) {
  FfnBlocking b;
  b.dot = true;
  b.dot_op = op;
  b.direct = direct;
  return b;
}

std::vector<FfnBlocking> DotForms(bool amx) {
  std::vector<FfnBlocking> forms;
  for (const DotName& d : kDotNames) {
    if (d.op == FfnBlocking::DotOp::kVdp && !amx) continue;  // "dot" is vdpbf16ps there
    for (bool direct : {false, true}) forms.push_back(DotKernels(d.op, direct));
  }
  return forms;
}

bool SameFfnLayout(const FfnBlocking& a, const FfnBlocking& b) {
  return a.dot == b.dot && (a.dot || a.panel_cols() == b.panel_cols());
}

int FfnRowClass(int64_t rows_per_expert) {
  int c = 0;
  while (c + 1 < kFfnRowClasses && rows_per_expert >= kRowClassFirst[c + 1]) ++c;
  return c;
}
const char* FfnRowClassName(int row_class) { return kRowClassNames[row_class]; }
int64_t FfnRowClassFirst(int row_class) { return kRowClassFirst[row_class]; }
int64_t FfnRowClassSample(int row_class) { return kRowClassSample[row_class]; }
bool FfnFormServes(const FfnBlocking& b, int row_class) {
  return !(b.dot && b.direct) || FfnRowClass(detail::kDotDirectRows) >= row_class;
}

int FewRowTuneExperts(int64_t cache_bytes, int64_t expert_bytes, int64_t budget_bytes) {
  const int64_t expert = std::max<int64_t>(expert_bytes, 1);
  const int64_t wanted = detail::CeilDiv(2 * std::max<int64_t>(cache_bytes, 0), expert);
  const int64_t allowed = std::max<int64_t>(budget_bytes, 0) / (2 * expert);
  return static_cast<int>(std::clamp<int64_t>(std::min(wanted, allowed), 1, 1 << 20));
}

FfnPlan FfnPlan::Uniform(const FfnBlocking& b) {
  FfnPlan plan;
  for (int c = 0; c < kFfnRowClasses; ++c) {
    plan.forms[c] = b;
    if (b.dot) plan.forms[c].direct = FfnFormServes(DotKernels(b.dot_op, true), c);
  }
  return plan;
}

std::string FfnPlan::ToString() const {
  FfnBlocking base = forms[0];
  base.direct = false;  // a dot form's name says "staged above 8 rows" in a uniform plan
  if (Uniform(base) == *this) return base.ToString();
  std::string out;
  for (int c = 0; c < kFfnRowClasses; ++c) {
    absl::StrAppend(&out, c == 0 ? "" : "; ", kRowClassNames[c], ": ", forms[c].ToString());
  }
  return out;
}

absl::StatusOr<FfnPlan> ParseFfnPlan(absl::string_view text) {
  if (text.find(':') == absl::string_view::npos) {
    absl::StatusOr<FfnBlocking> b = ParseFfnBlocking(text);
    if (!b.ok()) return b.status();
    return FfnPlan::Uniform(*b);
  }
  FfnPlan plan;
  bool seen[kFfnRowClasses] = {};
  for (absl::string_view item : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, ':');
    const absl::string_view name = absl::StripAsciiWhitespace(kv.first);
    int c = 0;
    while (c < kFfnRowClasses && name != kRowClassNames[c]) ++c;
    if (c == kFfnRowClasses) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FFN plan: unknown row class '", name.substr(0, 16), "' (classes: 1, 2-8, 9-64, 65+)"));
    }
    absl::StatusOr<FfnBlocking> b = ParseFfnBlocking(kv.second);
    if (!b.ok()) return b.status();
    if (!FfnFormServes(*b, c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("FFN plan: ", b->ToString(), " reads x directly, for at most ",
                       detail::kDotDirectRows, " rows, not ", kRowClassNames[c]));
    }
    plan.forms[c] = *b;
    seen[c] = true;
  }
  for (int c = 0; c < kFfnRowClasses; ++c) {
    if (!seen[c]) {
      return absl::InvalidArgumentError(
          absl::StrCat("FFN plan: no form for the row class ", kRowClassNames[c]));
    }
    if (!SameFfnLayout(plan.forms[c], plan.forms[0])) {
      return absl::InvalidArgumentError(absl::StrCat("FFN plan: ", plan.forms[c].ToString(),
                                                     " and ", plan.forms[0].ToString(),
                                                     " read different weight layouts"));
    }
  }
  return plan;
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
