// Reaching the server and the questions epserve-load asks it around its steps: the
// channels, the hidden size from ModelMetadata, ModelStatistics and what happened between
// two of them. Each function is thread-safe (it makes its own stub and context).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/load_stats.h"
#include "grpc_service.pb.h"

namespace epserve::client {

// How to reach the server.
struct ChannelOptions {
  std::string target = "127.0.0.1:8001";
  int num_connections = 1;
  bool tls = false;             // TLS; with tls_ca_pem empty, the system's roots
  std::string tls_ca_pem;       // PEM roots that sign the server's certificate
  std::string tls_cert_pem;     // client certificate chain (mutual TLS), or ""
  std::string tls_key_pem;      // its private key, or ""
  std::string tls_server_name;  // name to check the certificate against, or "" (the host)
};

// Channels to the target, each on its own TCP connection, without message size limits
// (a response of T x H floats easily exceeds gRPC's 4 MiB default).
std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const ChannelOptions& options);

// OK once every channel is READY. UNAVAILABLE naming `target` and the channel state when
// one is not READY within `timeout`.
absl::Status WaitForChannels(const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                             absl::string_view target, absl::Duration timeout);

// H of `model`, from ModelMetadata: the input "hidden_states" must be FP32 with shape
// [-1, H], H > 0. The RPC's status (with the model named) if the call fails,
// FAILED_PRECONDITION if the metadata does not have that form.
absl::StatusOr<int64_t> QueryHiddenSize(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& model, absl::Duration timeout,
                                        const std::string& token = "");

// The cumulative ModelStatistics of `model`; the RPC's status (model named) on failure.
absl::StatusOr<inference::ModelStatistics> QueryStatistics(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& model, absl::Duration timeout,
    const std::string& token = "");

// What happened at the server between two ModelStatistics snapshots (see ServerSplit).
ServerSplit SplitBetween(const inference::ModelStatistics& before,
                         const inference::ModelStatistics& after);

}  // namespace epserve::client
