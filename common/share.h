// The contiguous share of n items over p parts, written once: experts over workers (the
// contiguous placement, the memory estimate, the contiguous balancedness), a batch's rows over
// workers (worker::RowSplit) and the shared expert's intermediate columns over workers
// (model::SharedExpertSlice).
#pragma once

#include <cstdint>

namespace epserve::common {

// Items [begin, end) of a share.
struct Share {
  int64_t begin = 0;
  int64_t end = 0;
  constexpr int64_t size() const { return end - begin; }
};

// Where share `part` of `parts` of `total` items begins: total * part / parts, rounded down.
// Share p is [ShareBegin(total, p, parts), ShareBegin(total, p + 1, parts)): the shares cover
// [0, total) in order and their sizes differ by at most one. Needs 0 <= part <= parts,
// parts >= 1 and total * parts within int64_t.
constexpr int64_t ShareBegin(int64_t total, int64_t part, int64_t parts) {
  return total * part / parts;
}

// Share `part` (0 <= part < parts) of `total` items over `parts` parts.
constexpr Share ContiguousShare(int64_t total, int64_t part, int64_t parts) {
  return {ShareBegin(total, part, parts), ShareBegin(total, part + 1, parts)};
}

}  // namespace epserve::common
