// Stage timings of worker/'s own files. Private to worker/.
#pragma once

#include <cstdint>

#include "absl/time/time.h"

namespace epserve::worker::detail {

// Nanoseconds from `start` to now (a stage's time in WorkerReport::stage_ns, ExchangeStats).
inline int64_t NanosSince(absl::Time start) {
  return absl::ToInt64Nanoseconds(absl::Now() - start);
}

}  // namespace epserve::worker::detail
