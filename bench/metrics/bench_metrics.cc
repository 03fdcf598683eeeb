// What recording the metrics of one request and one batch costs, beside a relaxed atomic
// increment measured in the same run, on 1 thread and on 4 threads at once.
//   build/bench/metrics/bench_metrics
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "server/metrics.h"

namespace {

constexpr int kOps = 2'000'000;

template <typename F>
double NanosPerOp(int threads, F op) {
  std::vector<std::thread> pool;
  const absl::Time start = absl::Now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int i = 0; i < kOps; ++i) op(i);
    });
  }
  for (auto& th : pool) th.join();
  return absl::ToDoubleNanoseconds(absl::Now() - start) / kOps;
}

}  // namespace

int main() {
  const epserve::server::ServedModel model{.layers = {0}, .num_workers = 2, .num_experts = 60};
  auto metrics =
      epserve::server::Metrics::Start(epserve::server::MetricsHttpOptions(), "moe", model, 0);
  if (!metrics.ok()) {
    std::fprintf(stderr, "%s\n", metrics.status().ToString().c_str());
    return 1;
  }
  epserve::server::Metrics& m = **metrics;
  epserve::worker::BatchTrace trace;
  trace.stage_ns.assign(2, {1000, 2000, 3000, 4000, 5000});
  trace.expert_tokens.assign(60, 3);
  std::atomic<int64_t> counter{0};
  std::printf("%-44s %12s %12s\n", "operation (ns per call, wall clock)", "1 thread", "4 threads");
  const double atomic1 =
      NanosPerOp(1, [&](int) { counter.fetch_add(1, std::memory_order_relaxed); });
  const double atomic4 =
      NanosPerOp(4, [&](int) { counter.fetch_add(1, std::memory_order_relaxed); });
  auto request = [&](int i) {
    m.RequestStarted();
    m.ObserveRequest(absl::StatusCode::kOk, absl::Microseconds(100 + i % 1000),
                     absl::Microseconds(10), 16);
  };
  const double req1 = NanosPerOp(1, request);
  const double req4 = NanosPerOp(4, request);
  const double batch1 = NanosPerOp(1, [&](int) { m.ObserveBatch(trace, 64, 0); });
  std::printf("%-44s %12.1f %12.1f\n", "baseline: relaxed atomic increment", atomic1, atomic4);
  std::printf("%-44s %12.1f %12.1f\n", "one request (started + observed)", req1, req4);
  std::printf("%-44s %12.1f %12s\n", "one batch (2 workers, 60 experts)", batch1, "-");
  std::printf("one request costs %.0fx an atomic increment on 1 thread\n", req1 / atomic1);
  return 0;
}
