#include "client/server_queries.h"

#include <grpc/grpc.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/detail/grpc_call.h"
#include "client/infer_request.h"
#include "grpc_service.grpc.pb.h"

namespace epserve::client {

using detail::AddToken;
using detail::DeadlineAfter;

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const ChannelOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < options.num_connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // A private subchannel pool and a distinct argument give each channel its own
    // connection instead of sharing one through the global pool.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("epserve.load.connection_index", i);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
    channels.push_back(grpc::CreateCustomChannel(options.target, credentials, args));
  }
  return channels;
}

namespace {

absl::string_view ChannelStateName(grpc_connectivity_state state) {
  switch (state) {
    case GRPC_CHANNEL_IDLE:
      return "IDLE";
    case GRPC_CHANNEL_CONNECTING:
      return "CONNECTING";
    case GRPC_CHANNEL_READY:
      return "READY";
    case GRPC_CHANNEL_TRANSIENT_FAILURE:
      return "TRANSIENT_FAILURE";
    case GRPC_CHANNEL_SHUTDOWN:
      return "SHUTDOWN";
  }
  return "UNKNOWN_STATE";
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

}  // namespace

absl::Status WaitForChannels(const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                             absl::string_view target, absl::Duration timeout) {
  const auto deadline = DeadlineAfter(timeout);
  for (const auto& channel : channels) {
    if (!channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("cannot connect to ", target, " within ",
                                                 absl::FormatDuration(timeout), " (channel state ",
                                                 ChannelStateName(channel->GetState(false)),
                                                 "); is the server running and listening there?"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> QueryHiddenSize(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& model, absl::Duration timeout,
                                        const std::string& token) {
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(timeout));
  AddToken(context, token);
  inference::ModelMetadataRequest request;
  request.set_name(model);
  inference::ModelMetadataResponse response;
  grpc::Status status = stub->ModelMetadata(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, absl::StrCat("ModelMetadata(\"", model, "\")"));
  for (const auto& input : response.inputs()) {
    if (input.name() != kInputName) continue;
    if (input.datatype() != kDatatype || input.shape_size() != 2 || input.shape(1) <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model \"", model, "\" input ", kInputName, " is ", input.datatype(), " [",
          absl::StrJoin(input.shape(), ","), "]; expected ", kDatatype, " [-1,H] with H > 0"));
    }
    return input.shape(1);
  }
  return absl::FailedPreconditionError(
      absl::StrCat("model \"", model, "\" has no input named ", kInputName));
}

absl::StatusOr<inference::ModelStatistics> QueryStatistics(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& model, absl::Duration timeout,
    const std::string& token) {
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(timeout));
  AddToken(context, token);
  inference::ModelStatisticsRequest request;
  request.set_name(model);
  inference::ModelStatisticsResponse response;
  grpc::Status status = stub->ModelStatistics(&context, request, &response);
  if (!status.ok()) return FromGrpc(status, absl::StrCat("ModelStatistics(\"", model, "\")"));
  for (const auto& stats : response.model_stats()) {
    if (stats.name() == model || response.model_stats_size() == 1) return stats;
  }
  return absl::NotFoundError(absl::StrCat("ModelStatistics has no entry for \"", model, "\""));
}

ServerSplit SplitBetween(const inference::ModelStatistics& before,
                         const inference::ModelStatistics& after) {
  const auto& b = before.inference_stats();
  const auto& a = after.inference_stats();
  auto count = [](const inference::StatisticDuration& x, const inference::StatisticDuration& y) {
    return static_cast<int64_t>(y.count()) - static_cast<int64_t>(x.count());
  };
  auto mean_ms = [](const inference::StatisticDuration& x, const inference::StatisticDuration& y) {
    const double n = static_cast<double>(y.count()) - static_cast<double>(x.count());
    return n > 0 ? (static_cast<double>(y.ns()) - static_cast<double>(x.ns())) / n / 1e6 : 0.0;
  };
  ServerSplit s;
  s.requests = count(b.success(), a.success());
  s.failed = count(b.fail(), a.fail());
  s.queue_ms = mean_ms(b.queue(), a.queue());
  s.compute_input_ms = mean_ms(b.compute_input(), a.compute_input());
  s.compute_infer_ms = mean_ms(b.compute_infer(), a.compute_infer());
  s.compute_output_ms = mean_ms(b.compute_output(), a.compute_output());
  s.batches = static_cast<int64_t>(after.execution_count()) -
              static_cast<int64_t>(before.execution_count());
  // Rows per batch from the per-size batch counts.
  auto rows_of = [](const inference::ModelStatistics& m) {
    double rows = 0;
    for (const auto& bs : m.batch_stats()) {
      rows +=
          static_cast<double>(bs.batch_size()) * static_cast<double>(bs.compute_infer().count());
    }
    return rows;
  };
  if (s.batches > 0) {
    s.mean_batch_rows = (rows_of(after) - rows_of(before)) / static_cast<double>(s.batches);
  }
  return s;
}

}  // namespace epserve::client
