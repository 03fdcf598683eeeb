// Whole-file reads shared by every part of epserve.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace epserve::common {

// The whole file, bytes as stored; NOT_FOUND when it cannot be opened, DATA_LOSS when reading
// fails part way.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace epserve::common
