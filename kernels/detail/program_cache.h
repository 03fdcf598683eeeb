// The on-disk cache of OpenCL program binaries. Private to kernels/.
// A binary is stored under a key that hashes everything that could change it: the source,
// the build options and the device's platform, name, version and driver version.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/runtime.h"

namespace epserve::kernels::detail {

// 32 hex digits (two independent 64-bit FNV-1a hashes of the length-prefixed fields).
std::string ProgramCacheKey(std::string_view source, std::string_view options,
                            const DeviceInfo& device);

// "<dir>/<name>-<key>.bin".
std::string ProgramCachePath(std::string_view dir, std::string_view name, std::string_view key);

// Writes `bytes` to a temporary file beside `path` and renames it over `path`, so readers
// see either no file or a complete one. Creates the folder when missing.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

}  // namespace epserve::kernels::detail
