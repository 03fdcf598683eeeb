// FrontEndOptions::Validate: each group's check (requests, batching, service, streams), the
// bounds between groups and the front-end's own, each refusal naming the flag and its bound
// as epserve prints it.
#include <cstdint>
#include <functional>
#include <string>

#include "gtest/gtest.h"
#include "server/front_end.h"

namespace epserve::server {
namespace {

// The message Validate gives for the defaults changed by `change` ("" when valid).
std::string Refusal(const std::function<void(FrontEndOptions&)>& change) {
  FrontEndOptions o;
  change(o);
  const absl::Status s = o.Validate();
  EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kInvalidArgument) << s;
  return std::string(s.message());
}

TEST(FrontEndOptions, DefaultsAreValid) {
  EXPECT_EQ(Refusal([](FrontEndOptions&) {}), "");
}

TEST(FrontEndOptions, PriorityFlagsAreCheckedAsParsed) {
  // The flags are 64-bit integers: a value past 2^32 is refused, not wrapped.
  for (int64_t levels : {int64_t{0}, int64_t{-1}, int64_t{1001}, int64_t{1} << 32}) {
    EXPECT_EQ(Refusal([&](FrontEndOptions& o) { o.requests.priority_levels = levels; }),
              "--priority-levels must be in [1, 1000]")
        << levels;
  }
  EXPECT_EQ(Refusal([](FrontEndOptions& o) {
              o.requests.priority_levels = 1000;
              o.requests.default_priority = 1000;
            }),
            "");
  for (int64_t level : {int64_t{0}, int64_t{4}, int64_t{1} << 32}) {
    EXPECT_EQ(Refusal([&](FrontEndOptions& o) { o.requests.default_priority = level; }),
              "--default-priority must be in [1, --priority-levels=3]")
        << level;
  }
}

TEST(FrontEndOptions, EveryGroupIsChecked) {
  const std::pair<std::function<void(FrontEndOptions&)>, std::string> cases[] = {
      {[](FrontEndOptions& o) { o.batching.max_batch_tokens = 0; },
       "--max-batch-tokens must be >= 1"},
      {[](FrontEndOptions& o) { o.batching.max_queue_delay_us = -1; },
       "--max-queue-delay-us must be >= 0"},
      {[](FrontEndOptions& o) { o.batching.direct_batch_tokens = -1; },
       "--direct-batch-tokens must be >= 0"},
      {[](FrontEndOptions& o) { o.requests.max_request_tokens = 0; },
       "--max-request-tokens must be >= 1"},
      {[](FrontEndOptions& o) { o.batching.max_queue_tokens = 100; },
       "--max-queue-tokens (100) must be >= --max-request-tokens (8192)"},
      {[](FrontEndOptions& o) { o.max_response_bytes = 1023; },
       "--max-request-bytes and --max-response-bytes must be 0 (derived from the model) or in "
       "[1024, 2147483647]"},
      {[](FrontEndOptions& o) { o.service.max_stream_inflight = 0; },
       "--max-stream-inflight must be >= 1"},
      {[](FrontEndOptions& o) { o.service.max_inflight_bytes = -1; },
       "--max-inflight-bytes must be >= 0 (0: derived)"},
      {[](FrontEndOptions& o) { o.service.answer_timeout = absl::ZeroDuration(); },
       "--answer-timeout must be > 0"},
      {[](FrontEndOptions& o) { o.streams.max_connections = 0; },
       "--grpc-max-connections must be >= 1"},
      {[](FrontEndOptions& o) { o.streams.max_streams = 0; },
       "--max-concurrent-streams must be >= 1"},
      {[](FrontEndOptions& o) { o.grpc_memory_quota = 1000; },
       "--grpc-memory-quota must be 0 (derived) or >= 1048576"},
      {[](FrontEndOptions& o) { o.worker_stall_timeout = absl::ZeroDuration(); },
       "--worker-stall-timeout must be > 0"},
  };
  for (const auto& [change, message] : cases) EXPECT_EQ(Refusal(change), message);
}

}  // namespace
}  // namespace epserve::server
