// Serving through a worker's death, end to end: the job runs under `mpirun --enable-recovery`
// with every expert held by two workers (--redundant-experts) and the shared expert on each
// token's owner (--shared-expert=owner); four clients verify every answer against the
// reference while a worker is killed with SIGKILL. Nothing wrong, at most the batches in
// flight failed, answers resume within a second, health stays SERVING, the metrics show the
// loss and the survivors' copies. Without full coverage the job ends (as plain mpirun ends it),
// so that its supervisor restarts it.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "health.grpc.pb.h"
#include "tests/common/http_get.h"
#include "tests/e2e/reference.h"
#include "tests/e2e/server_process.h"
#include "tests/e2e/verifying_clients.h"

namespace epserve::testing {
namespace {

constexpr int kExperts = 8;  // synthetic:tiny
using Clock = VerifyingClients::Clock;

grpc::health::v1::HealthCheckResponse::ServingStatus Health(const ServerProcess& server) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(server.grpc_address(), grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!stub->Check(&ctx, req, &resp).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return resp.status();
}

// Copies of layer 0's experts in a scrape (epserve_expert_replicas), -1 where one is missing.
std::vector<double> Replicas(const std::string& metrics) {
  std::vector<double> copies;
  for (int e = 0; e < kExperts; ++e) {
    copies.push_back(MetricValue(
        metrics, absl::StrCat("epserve_expert_replicas{expert=\"", e, "\",layer=\"0\"}")));
  }
  return copies;
}

struct Case {
  const char* name;
  std::vector<std::string> flags;  // beyond the common ones
};

class WorkerDeath : public ::testing::TestWithParam<Case> {};

TEST_P(WorkerDeath, WithFullCoverageTheSurvivorsServeOn) {
  std::vector<std::string> flags = {"--max-batch-tokens=32", "--max-queue-delay-us=500",
                                    "--redundant-experts=8", "--shared-expert=owner"};
  flags.insert(flags.end(), GetParam().flags.begin(), GetParam().flags.end());
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(4, flags, absl::Seconds(120), {"--enable-recovery"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::vector<double> before = Replicas(HttpGet((*server)->metrics_address(), "/metrics"));
  for (double c : before) EXPECT_EQ(c, 2);

  VerifyingClients clients(**server);
  // Load for 3 s (at least 40 answers), then worker 1 (rank 2) dies.
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Seconds(3) ||
         (clients.answered() < 40 && absl::Now() - start < absl::Seconds(30))) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const pid_t victim = (*server)->RankPid(2);
  ASSERT_GT(victim, 0) << "no process for rank 2";
  const size_t answered_before = clients.answered();
  const Clock::time_point killed = Clock::now();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  // Health right after the death, and 5 s of load with the survivors.
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(Health(**server), grpc::health::v1::HealthCheckResponse::SERVING);
  // The dead worker's stage histograms stop (no zero-length stages for it).
  const std::string dead_stage = "epserve_stage_duration_seconds_count{rank=\"2\",stage=\"route\"}";
  const double dead_batches =
      MetricValue(HttpGet((*server)->metrics_address(), "/metrics"), dead_stage);
  absl::SleepFor(absl::Seconds(5));
  EXPECT_EQ(Health(**server), grpc::health::v1::HealthCheckResponse::SERVING);
  clients.Stop();

  EXPECT_EQ(clients.wrong(), 0);
  // At most the batches in flight when it died: with 4 clients, 4 requests.
  EXPECT_LE(clients.failures().size(), 4u);
  for (const std::string& f : clients.failures()) EXPECT_NE(f.find("14 "), std::string::npos) << f;
  // Answers resume within 1 s: no gap of a second between two answers from the kill on, and
  // answers through the end.
  const std::vector<Clock::time_point> at = clients.answered_at();
  Clock::time_point last = killed;
  double longest_gap = 0;
  size_t after = 0;
  for (const Clock::time_point& t : at) {
    if (t < killed) continue;
    ++after;
    longest_gap = std::max(longest_gap, std::chrono::duration<double>(t - last).count());
    last = t;
  }
  EXPECT_LT(longest_gap, 1.0) << "seconds without an answer after the kill";
  EXPECT_GT(after, 40u);
  std::cerr << answered_before << " answers before the kill, " << after << " after; "
            << clients.failures().size() << " failed; longest gap after the kill "
            << longest_gap * 1e3 << " ms\n";
  for (const std::string& f : clients.failures()) std::cerr << "  failed: " << f << "\n";

  const std::string metrics = HttpGet((*server)->metrics_address(), "/metrics");
  EXPECT_EQ(MetricValue(metrics, "epserve_workers_ready"), 2) << metrics;
  EXPECT_EQ(MetricValue(metrics, "epserve_workers_lost"), 1);
  EXPECT_EQ(MetricValue(metrics, "epserve_workers_configured"), 3);
  EXPECT_GT(dead_batches, 0) << metrics;
  EXPECT_EQ(MetricValue(metrics, dead_stage), dead_batches);
  // The survivors' copies: every expert keeps at least one, fewer copies in all than before.
  const std::vector<double> now = Replicas(metrics);
  double total = 0;
  for (double c : now) {
    EXPECT_GE(c, 1);
    total += c;
  }
  EXPECT_LT(total, 2 * kExperts);
  const std::string log = (*server)->Log();
  EXPECT_NE(log.find("worker 1 (rank 2, pid " + std::to_string(victim) +
                     ") died; live workers: 0, 2; serving on with them"),
            std::string::npos)
      << log;

  // A clean stop: the survivors leave without waiting for the dead rank.
  absl::StatusOr<ServerExit> exit = (*server)->Stop(SIGTERM, absl::Seconds(20));
  EXPECT_TRUE(exit.ok()) << exit.status();
  if (HasFailure()) ADD_FAILURE() << "seed " << clients.seed() << "\n" << (*server)->Log();
}

INSTANTIATE_TEST_SUITE_P(
    Modes, WorkerDeath,
    ::testing::Values(Case{"Static", {}},
                      // Rebalancing every 4 batches, before the death and over the survivors,
                      // every placement keeping two copies of each expert.
                      Case{"OnlineEplb",
                           {"--eplb-interval=4", "--eplb-min-gain=0", "--eplb-min-copies=2"}}),
    [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

// Without a second copy of every expert, a worker's death ends the job (the supervisor's
// restart, as without --enable-recovery).
TEST(WorkerDeath, WithoutFullCoverageTheJobEnds) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(3, {"--max-batch-tokens=32", "--shared-expert=owner"},
                           absl::Seconds(120), {"--enable-recovery"});
  ASSERT_TRUE(server.ok()) << server.status();
  const pid_t victim = (*server)->RankPid(2);
  ASSERT_GT(victim, 0);
  const absl::Time killed = absl::Now();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  int code = 0;
  while (!(*server)->Exited(&code) && absl::Now() - killed < absl::Seconds(20)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const absl::Duration took = absl::Now() - killed;
  // (mpirun --enable-recovery exits with 0 after MPI_Abort: its supervisor restarts any job
  // that ends without being asked to, whatever its status.)
  EXPECT_LT(took, absl::Seconds(20)) << "the job did not end";
  const std::string log = (*server)->Log();
  EXPECT_NE(log.find("expert 4 has no copy on a live worker"), std::string::npos) << log;
  EXPECT_NE(log.find("cannot go on without it"), std::string::npos) << log;
  std::cerr << "the job ended " << absl::FormatDuration(took) << " after the kill\n";
}

}  // namespace
}  // namespace epserve::testing
