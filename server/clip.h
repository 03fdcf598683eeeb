// Client strings quoted in error messages are bounded: a 1 MiB model name must cost an error
// of a few hundred bytes, not a trailer past gRPC's metadata limit (which turned a NOT_FOUND
// into RESOURCE_EXHAUSTED "received metadata size exceeds hard limit").
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace epserve::server {

inline constexpr size_t kMaxQuotedBytes = 128;

// `s` itself when it has at most kMaxQuotedBytes bytes, else its first kMaxQuotedBytes bytes
// followed by "... (N bytes)".
inline std::string Clip(absl::string_view s) {
  if (s.size() <= kMaxQuotedBytes) return std::string(s);
  return absl::StrCat(s.substr(0, kMaxQuotedBytes), "... (", s.size(), " bytes)");
}

}  // namespace epserve::server
