#include "server/auth.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/files.h"

namespace epserve::server {
namespace {

constexpr char kHealthPrefix[] = "/grpc.health.v1.Health/";

// Compares without returning early, so timing does not tell how much of a guess matched.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(const Authenticator& auth, grpc::experimental::ServerRpcInfo* info)
      : auth_(auth), exempt_(absl::StartsWith(info->method(), kHealthPrefix)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using Hook = grpc::experimental::InterceptionHookPoints;
    if (!exempt_ && methods->QueryInterceptionHookPoint(Hook::POST_RECV_INITIAL_METADATA)) {
      denied_ = !auth_.CheckMetadata(*methods->GetRecvInitialMetadata()).ok();
    }
    if (denied_ && methods->QueryInterceptionHookPoint(Hook::PRE_SEND_MESSAGE)) {
      if (grpc::ByteBuffer* buffer = methods->GetSerializedSendMessage(); buffer != nullptr) {
        grpc::Slice empty("");
        *buffer = grpc::ByteBuffer(&empty, 1);
      }
    }
    if (denied_ && methods->QueryInterceptionHookPoint(Hook::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(
          grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or wrong bearer token"));
    }
    methods->Proceed();
  }

 private:
  const Authenticator& auth_;
  const bool exempt_;
  bool denied_ = false;
};

class AuthInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(const Authenticator& auth) : auth_(auth) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new AuthInterceptor(auth_, info);
  }

 private:
  const Authenticator& auth_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Authenticator>> Authenticator::FromFile(
    const std::string& path) {
  if (path.empty()) return std::make_shared<const Authenticator>("");
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read --auth-token-file ", path));
  }
  const std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-token-file ", path, " is empty"));
  }
  return std::make_shared<const Authenticator>(token);
}

absl::Status Authenticator::CheckMetadata(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  if (token_.empty()) return absl::OkStatus();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("missing metadata 'authorization: Bearer <token>'");
  }
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ") || !ConstantTimeEquals(value, token_)) {
    return absl::UnauthenticatedError("wrong bearer token");
  }
  return absl::OkStatus();
}

absl::Status Authenticator::Check(const grpc::ServerContextBase& ctx) const {
  if (token_.empty()) return absl::OkStatus();
  return CheckMetadata(ctx.client_metadata());
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
Authenticator::InterceptorFactory() const {
  return std::make_unique<AuthInterceptorFactory>(*this);
}

}  // namespace epserve::server
