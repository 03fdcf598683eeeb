// The /metrics endpoint's lifetime: it serves once started and stops promptly.
#include "server/metrics.h"

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/common/http_get.h"

namespace epserve::server {
namespace {

// Two workers, four experts, one served layer (0).
const ServedModel kModel{.layers = {0}, .num_workers = 2, .num_experts = 4};

TEST(Metrics, ServesUntilDestroyedAndStopsWithoutWaitingOutTheListenerPoll) {
  // civetweb polls its listening socket for up to 2 s between looks at its stop flag; a
  // just-started endpoint is at the start of such a poll, so an unprompted stop takes ~2 s.
  for (int round = 0; round < 3; ++round) {
    absl::StatusOr<std::unique_ptr<Metrics>> m =
        Metrics::Start(MetricsHttpOptions(), "moe", kModel, 0);
    ASSERT_TRUE(m.ok()) << m.status();
    const std::string address = (*m)->bound_address();
    EXPECT_NE(epserve::testing::HttpGet(address, "/metrics").find("epserve_build_info"),
              std::string::npos)
        << address;
    const absl::Time start = absl::Now();
    m->reset();
    const absl::Duration took = absl::Now() - start;
    EXPECT_LT(took, absl::Seconds(1)) << "round " << round;
    EXPECT_EQ(epserve::testing::HttpGet(address, "/metrics"), "")
        << "still listening on " << address;
  }
}

}  // namespace
}  // namespace epserve::server
