// What every client call sets on its grpc::ClientContext: a deadline and the bearer token.
// Private to client/.
#pragma once

#include <chrono>
#include <string>

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace epserve::client::detail {

// The system-clock time point `timeout` from now, as gRPC deadlines take it.
inline std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             absl::ToChronoNanoseconds(timeout));
}

// Adds "authorization: Bearer <token>" to `context`, unless `token` is empty.
inline void AddToken(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
}

}  // namespace epserve::client::detail
