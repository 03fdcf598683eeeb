// The one place where absl::Status becomes grpc::Status (the codes agree numerically).
#pragma once

#include <grpcpp/support/status.h>

#include <string>
#include "absl/status/status.h"

namespace epserve::server {

// Messages are capped (kMaxMessageBytes, then "... (truncated)") whatever they quote: the
// message travels percent-encoded in the grpc-message trailer, under gRPC's metadata limit.
inline constexpr size_t kMaxMessageBytes = 2048;
inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string message(s.message().substr(0, kMaxMessageBytes));
  if (s.message().size() > kMaxMessageBytes) message += "... (truncated)";
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::move(message));
}

}  // namespace epserve::server
