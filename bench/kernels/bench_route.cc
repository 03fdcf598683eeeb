// Times the router (kernels::Route: logits, top-k selection and weights) for the
// qwen1.5-moe-a2.7b router (60 experts, H=2048, softmax top-4) at 1..512 tokens, against
// OpenBLAS sgemm computing the logits alone ([n x E x H], contiguous, best thread count),
// measured in the same run, timed round-robin.
//
//   bench_route [--tokens=1,8,32,128,512] [--threads=2]
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_support.h"
#include "common/flags.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/synthetic.h"

extern "C" void openblas_set_num_threads(int);
extern "C" char* openblas_get_corename(void);

namespace epserve::kernels {
namespace {

// Median seconds of each of `fns`, timed round-robin after warm-up; fns[0] is epserve's
// router, timed once the workers OpenBLAS leaves spinning after a call (on sched_yield, for
// about 0.1 s) have gone idle, so that they do not share the cores with it. The OpenBLAS
// variants run back to back, their workers warm.
std::vector<double> RoundRobinMedianSeconds(const std::vector<std::function<void()>>& fns,
                                            bench::IdleThreadsWait& idle_threads) {
  std::vector<bool> settle_before(fns.size(), false);
  settle_before[0] = true;
  return bench::RoundRobinMedianSeconds(fns, 3, 21, 61, 1.0, nullptr,
                                        idle_threads.Before(std::move(settle_before)));
}

int Run(int argc, char** argv) {
  std::vector<int64_t> tokens = {1, 8, 32, 128, 512};
  int threads = 2;
  common::FlagSet fs("bench_route", "The router kernel against OpenBLAS sgemm, same run.");
  fs.Add("tokens", &tokens, "Comma list of token counts");
  fs.Add("threads", &threads, "OpenBLAS threads at most");
  const int code = bench::ParseFlags(
      fs, argc, argv, [&] { return threads >= 1 && bench::AllPositive(tokens); },
      "--threads and every --tokens entry must be >= 1");
  if (code >= 0) return code;
  bench::PrintCoretype();
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("qwen1.5-moe-a2.7b");
  if (!cfg.ok()) return 1;
  const model::SyntheticWeights source(*cfg, 1234);
  const model::MoeLayerConfig& c = cfg->layer;
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(RuntimeOptions{});
  if (!rt.ok()) {
    std::fprintf(stderr, "%s\n", std::string(rt.status().message()).c_str());
    return 1;
  }
  Runtime& r = **rt;
  absl::StatusOr<RouterWeights> w = UploadRouter(r, source, 0);
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", std::string(w.status().message()).c_str());
    return 1;
  }
  std::vector<float> router(static_cast<size_t>(c.num_experts) * c.hidden_size);
  if (!source.Fill(0, model::TensorKind::kRouter, 0, router.data()).ok()) return 1;
  std::printf("device: %s\n", r.device_info().Describe().c_str());
  std::printf(
      "router: E=%d H=%lld top-%d; POCL_MAX_PTHREAD_COUNT=%s\n", c.num_experts,
      static_cast<long long>(c.hidden_size), c.top_k,
      std::getenv("POCL_MAX_PTHREAD_COUNT") ? std::getenv("POCL_MAX_PTHREAD_COUNT") : "(unset)");
  bench::PrintLoadAverage("before");
  std::printf("\n");
  std::printf(
      "| tokens | Route ms (logits + top-k) | Route logits GFLOP/s | OpenBLAS sgemm logits ms | "
      "sgemm threads | Route / sgemm time |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  bench::IdleThreadsWait idle_threads;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t n : tokens) {
    std::vector<float> x(n * c.hidden_size);
    for (float& v : x) v = dist(rng);
    absl::StatusOr<Buffer> xb = r.AllocateCopy(x.data(), x.size() * sizeof(float));
    absl::StatusOr<Buffer> ids = r.Allocate(n * c.top_k * sizeof(int32_t));
    absl::StatusOr<Buffer> wts = r.Allocate(n * c.top_k * sizeof(float));
    if (!xb.ok() || !ids.ok() || !wts.ok()) return 1;
    bool failed = false;
    std::vector<float> logits(n * c.num_experts);
    std::vector<std::function<void()>> fns = {[&] {
      absl::Status s = Route(r, *w, *xb, n, *ids, *wts);
      if (s.ok()) s = r.Finish();
      if (!s.ok()) failed = true;
    }};
    for (int t = 1; t <= threads; ++t) {
      fns.push_back([&, t] {
        openblas_set_num_threads(t);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), c.num_experts,
                    static_cast<int>(c.hidden_size), 1.0f, x.data(), c.hidden_size, router.data(),
                    c.hidden_size, 0.0f, logits.data(), c.num_experts);
      });
    }
    const std::vector<double> med = RoundRobinMedianSeconds(fns, idle_threads);
    if (failed) return 1;
    int best = 1;
    for (int t = 2; t <= threads; ++t) {
      if (med[t] < med[best]) best = t;
    }
    const double flops = 2.0 * n * c.num_experts * c.hidden_size;
    std::printf("| %lld | %.3f | %.1f | %.3f | %d | %.2f |\n", static_cast<long long>(n),
                med[0] * 1e3, flops / med[0] / 1e9, med[best] * 1e3, best, med[0] / med[best]);
    std::fflush(stdout);
  }
  std::printf("\n");
  idle_threads.PrintWarningIfAny();
  bench::PrintLoadAverage("after");
  return 0;
}

}  // namespace
}  // namespace epserve::kernels

int main(int argc, char** argv) {
  epserve::bench::ReexecWithoutCoretype(argv);
  epserve::bench::ReexecForUnknownCpu(argv, openblas_get_corename());
  return epserve::kernels::Run(argc, argv);
}
