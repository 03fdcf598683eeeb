// The one place where absl::Status becomes grpc::Status (the codes agree numerically), and
// the unary reply made of it.
#pragma once

#include <grpcpp/server_context.h>
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

// Finishes a unary callback call with `s` at once.
inline grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

}  // namespace epserve::server
