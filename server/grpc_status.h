// The one place where absl::Status becomes grpc::Status (the codes agree numerically).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace epserve::server {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace epserve::server
