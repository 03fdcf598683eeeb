// Bearer-token authentication (`--auth-token-file`): every RPC but grpc.health.v1.Health
// must carry the metadata `authorization: Bearer <token>`, or it answers UNAUTHENTICATED.
// Thread-safe: immutable after construction.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/status/statusor.h"

namespace epserve::server {

class Authenticator {
 public:
  // Reads the token from `path` (surrounding whitespace dropped). An empty path turns
  // authentication off; an unreadable or empty file is an error.
  static absl::StatusOr<std::shared_ptr<const Authenticator>> FromFile(const std::string& path);
  explicit Authenticator(std::string token) : token_(std::move(token)) {}

  bool enabled() const { return !token_.empty(); }
  // OK when authentication is off or the call carries the token; UNAUTHENTICATED otherwise.
  absl::Status Check(const grpc::ServerContextBase& ctx) const;
  absl::Status CheckMetadata(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

  // An interceptor for every service the front-end does not implement itself (reflection):
  // an unauthenticated call gets empty messages and ends UNAUTHENTICATED. Health is exempt.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory() const;

 private:
  const std::string token_;
};

}  // namespace epserve::server
