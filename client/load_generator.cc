#include "client/load_generator.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/detail/step_run.h"
#include "common/element_type.h"

namespace epserve::client {

absl::string_view ArrivalName(Arrival arrival) {
  return arrival == Arrival::kPoisson ? "poisson" : "constant";
}

absl::StatusOr<Arrival> ParseArrival(absl::string_view text) {
  if (text == "constant") return Arrival::kConstant;
  if (text == "poisson") return Arrival::kPoisson;
  return absl::InvalidArgumentError(
      absl::StrCat("arrival: '", text, "' is neither 'constant' nor 'poisson'"));
}

LoadGenerator::LoadGenerator(std::vector<std::shared_ptr<grpc::Channel>> channels,
                             LoadOptions options)
    : channels_(std::move(channels)), options_(std::move(options)) {
  for (auto& channel : channels_)
    stubs_.push_back(inference::GRPCInferenceService::NewStub(channel));
  // A stream has one deadline for all its requests; each request's own is the server's.
  if (options_.stream && options_.request.timeout_us == 0) {
    options_.request.timeout_us = absl::ToInt64Microseconds(options_.timeout);
  }
}

absl::Status LoadGenerator::Validate(const StepSpec& step) const {
  const LoadOptions& o = options_;
  if (stubs_.empty()) return absl::InvalidArgumentError("connections: need at least one channel");
  if (o.request.hidden_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: ", o.request.hidden_size, " must be > 0"));
  }
  if (o.tokens.min_tokens < 1 || o.tokens.max_tokens < o.tokens.min_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: range ", FormatTokenRange(o.tokens), " is empty"));
  }
  // A tensor must fit one protobuf bytes field (< 2 GiB).
  constexpr int64_t kMaxPayloadBytes = (int64_t{1} << 31) - (int64_t{1} << 20);
  if (o.tokens.max_tokens > kMaxPayloadBytes /
                                static_cast<int64_t>(common::ElementBytes(o.request.dtype)) /
                                o.request.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", o.tokens.max_tokens,
                                                   " rows of hidden size ", o.request.hidden_size,
                                                   " exceed the 2 GiB limit of one message"));
  }
  if (o.num_requests < 0) return absl::InvalidArgumentError("requests: must be >= 0");
  if (o.num_requests == 0 && o.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("duration: must be > 0 when --requests is 0");
  }
  if (o.warmup < absl::ZeroDuration()) return absl::InvalidArgumentError("warmup: must be >= 0");
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be > 0");
  if (o.num_threads < 1 || o.num_threads > 1023) {
    return absl::InvalidArgumentError("threads: must be in [1, 1023]");
  }
  if (o.max_outstanding < 1) return absl::InvalidArgumentError("max-outstanding: must be >= 1");
  if (o.stream && o.num_streams < 1) return absl::InvalidArgumentError("streams: must be >= 1");
  if (o.verifier != nullptr && o.verifier->hidden_size() != o.request.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify-model: hidden size ", o.verifier->hidden_size(),
                     " differs from the served model's ", o.request.hidden_size));
  }
  if (o.shared_memory != nullptr) {
    if (step.mode != LoadMode::kClosedLoop) {
      return absl::InvalidArgumentError("shared-memory: closed loop only (--concurrency)");
    }
    if (step.concurrency > o.shared_memory->slots()) {
      return absl::InvalidArgumentError(absl::StrCat("shared-memory: concurrency ",
                                                     step.concurrency, " exceeds the region's ",
                                                     o.shared_memory->slots(), " slots"));
    }
  }
  if (step.mode == LoadMode::kClosedLoop) {
    if (step.concurrency < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("concurrency: ", step.concurrency, " must be >= 1"));
    }
  } else if (!(step.rate_per_s > 0) || !std::isfinite(step.rate_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat("rate: ", step.rate_per_s, " must be > 0"));
  }
  return absl::OkStatus();
}

StepReport LoadGenerator::RunStep(const StepSpec& step, int step_index) {
  detail::StepRun run(options_, channels_, stubs_, step, step_index);
  return run.Run();
}

}  // namespace epserve::client
