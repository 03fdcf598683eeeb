// Times the grouped expert FFN (gate/up + SwiGLU + down) for the qwen1.5-moe-a2.7b expert
// shape against OpenBLAS sgemm doing the same three GEMMs per expert plus a plain C++ SwiGLU
// loop, and, for small row counts, the weight bytes streamed per second against memcpy.
// Every figure printed is measured in this run: medians of several repetitions after warm-up,
// epserve and OpenBLAS timed alternately so that both see the same machine conditions.
//
//   bench_expert_ffn [--experts=4] [--rows=1,8,32,128,512,2048] [--threads=2]
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/synthetic.h"

extern "C" char* openblas_get_config(void);
extern "C" char* openblas_get_corename(void);
extern "C" void openblas_set_num_threads(int);

namespace epserve::kernels {
namespace {

constexpr char kUnsetMarker[] = "EPSERVE_BENCH_UNSET_OPENBLAS_CORETYPE";

// OpenBLAS reads OPENBLAS_CORETYPE when the library loads, so drop it and start again.
void ReexecWithoutCoretype(char** argv) {
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if (coretype == nullptr) return;
  setenv(kUnsetMarker, coretype, 1);
  unsetenv("OPENBLAS_CORETYPE");
  execv("/proc/self/exe", argv);
  std::perror("execv /proc/self/exe");  // carry on with it set; the table says so
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median seconds of `fn` over repetitions after `warmup` calls: at least min_reps, more
// while under min_seconds in total, at most max_reps.
template <typename Fn>
double MedianSeconds(Fn&& fn, int warmup = 2, int min_reps = 5, int max_reps = 30,
                     double min_seconds = 1.0) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  double total = 0.0;
  while (static_cast<int>(times.size()) < min_reps ||
         (total < min_seconds && static_cast<int>(times.size()) < max_reps)) {
    const double t0 = NowSeconds();
    fn();
    times.push_back(NowSeconds() - t0);
    total += times.back();
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Median seconds of `a` and of `b`, timed alternately (a, b, a, b, ...) so that both see the
// same machine conditions; repetitions as for MedianSeconds.
template <typename FnA, typename FnB>
std::pair<double, double> PairedMedianSeconds(FnA&& a, FnB&& b, int warmup = 2, int min_reps = 7,
                                              int max_reps = 41, double min_seconds = 2.0) {
  for (int i = 0; i < warmup; ++i) {
    a();
    b();
  }
  std::vector<double> ta, tb;
  double total = 0.0;
  while (static_cast<int>(ta.size()) < min_reps ||
         (total < min_seconds && static_cast<int>(ta.size()) < max_reps)) {
    double t0 = NowSeconds();
    a();
    ta.push_back(NowSeconds() - t0);
    t0 = NowSeconds();
    b();
    tb.push_back(NowSeconds() - t0);
    total += ta.back() + tb.back();
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[ta.size() / 2], tb[tb.size() / 2]};
}

// Bytes copied per second by memcpy over `threads` threads, each on its own slice of a
// 512 MiB buffer (far beyond the caches).
double MemcpyBytesPerSecond(int threads) {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const double s = MedianSeconds([&] {
    std::vector<std::thread> pool;
    const size_t slice = bytes / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back(
          [&, t] { std::memcpy(dst.data() + t * slice, src.data() + t * slice, slice); });
    }
    for (std::thread& th : pool) th.join();
  });
  return static_cast<double>(bytes) / s;
}

int Run(int argc, char** argv) {
  int num_experts = 4;
  int threads = 2;
  std::vector<int64_t> rows_per_expert = {1, 8, 32, 128, 512, 2048};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--experts=", 0) == 0) {
      if (!absl::SimpleAtoi(arg.substr(10), &num_experts) || num_experts < 1) return 2;
    } else if (arg.rfind("--threads=", 0) == 0) {
      if (!absl::SimpleAtoi(arg.substr(10), &threads) || threads < 1) return 2;
    } else if (arg.rfind("--rows=", 0) == 0) {
      rows_per_expert.clear();
      for (absl::string_view r : absl::StrSplit(arg.substr(7), ',')) {
        int64_t v = 0;
        if (!absl::SimpleAtoi(r, &v) || v < 1) return 2;
        rows_per_expert.push_back(v);
      }
    } else {
      std::fprintf(stderr, "usage: %s [--experts=N] [--rows=a,b,...] [--threads=T]\n", argv[0]);
      return 2;
    }
  }
  if (const char* was = std::getenv(kUnsetMarker)) {
    std::printf("OPENBLAS_CORETYPE=%s was unset (re-executed) so OpenBLAS picks its own kernels\n",
                was);
  } else if (const char* still = std::getenv("OPENBLAS_CORETYPE")) {
    std::printf("WARNING: OPENBLAS_CORETYPE=%s is still set\n", still);
  } else {
    std::printf("OPENBLAS_CORETYPE is not set; OpenBLAS picks its own kernels\n");
  }
  openblas_set_num_threads(threads);
  std::printf("OpenBLAS: %s, core %s, %d threads\n", openblas_get_config(), openblas_get_corename(),
              threads);
  const char* pocl_threads = std::getenv("POCL_MAX_PTHREAD_COUNT");
  std::printf("POCL_MAX_PTHREAD_COUNT=%s\n", pocl_threads != nullptr ? pocl_threads : "(unset)");

  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("qwen1.5-moe-a2.7b");
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  const model::SyntheticWeights source(*cfg, 1234);
  const int64_t hidden = cfg->layer.hidden_size;
  const int64_t ffn = cfg->layer.expert_ffn_size;

  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(RuntimeOptions{});
  if (!rt.ok()) {
    std::fprintf(stderr, "%s\n", std::string(rt.status().message()).c_str());
    return 1;
  }
  Runtime& r = **rt;
  std::printf("device: %s\n", r.device_info().Describe().c_str());
  absl::StatusOr<ExpertWeights> w = UploadExperts(r, source, 0, 0, num_experts);
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", std::string(w.status().message()).c_str());
    return 1;
  }
  // Host weights for OpenBLAS, Hugging Face layout.
  std::vector<std::vector<float>> gate(num_experts), up(num_experts), down(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    gate[e].resize(ffn * hidden);
    up[e].resize(ffn * hidden);
    down[e].resize(hidden * ffn);
    if (!source.Fill(0, model::TensorKind::kExpertGate, e, gate[e].data()).ok() ||
        !source.Fill(0, model::TensorKind::kExpertUp, e, up[e].data()).ok() ||
        !source.Fill(0, model::TensorKind::kExpertDown, e, down[e].data()).ok()) {
      return 1;
    }
  }
  const double weight_bytes = 3.0 * hidden * ffn * sizeof(float) * num_experts;
  std::printf("shape: H=%lld F=%lld, %d experts, %.0f MiB of expert weights\n",
              static_cast<long long>(hidden), static_cast<long long>(ffn), num_experts,
              weight_bytes / (1 << 20));
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) {
    std::printf("load average before the run: %.2f %.2f %.2f (2 cores)\n\n", load[0], load[1],
                load[2]);
  }

  std::printf(
      "| rows/expert | epserve ms | epserve GFLOP/s | OpenBLAS ms | OpenBLAS GFLOP/s | "
      "ratio | epserve weight GB/s | memcpy GB/s | ratio | max rel diff |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t m : rows_per_expert) {
    const int64_t pairs = m * num_experts;
    std::vector<float> x(pairs * hidden);
    for (float& v : x) v = dist(rng);
    std::vector<int32_t> row_index(pairs);  // every row gathered from a shuffled token
    std::iota(row_index.begin(), row_index.end(), 0);
    std::shuffle(row_index.begin(), row_index.end(), rng);
    std::vector<int64_t> offsets(num_experts + 1);
    for (int e = 0; e <= num_experts; ++e) offsets[e] = e * m;

    absl::StatusOr<Buffer> xb = r.AllocateCopy(x.data(), x.size() * sizeof(float));
    absl::StatusOr<Buffer> ib = r.AllocateCopy(row_index.data(), pairs * sizeof(int32_t));
    absl::StatusOr<Buffer> hb = r.Allocate(pairs * ffn * sizeof(float));
    absl::StatusOr<Buffer> yb = r.Allocate(pairs * hidden * sizeof(float));
    if (!xb.ok() || !ib.ok() || !hb.ok() || !yb.ok()) return 1;
    bool failed = false;
    auto run_epserve = [&] {
      absl::Status s = ExpertFfn(r, *w, *xb, *ib, offsets, *hb, *yb);
      if (s.ok()) s = r.Finish();
      if (!s.ok() && !failed) {
        std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
        failed = true;
      }
    };
    // OpenBLAS: per expert, gather its rows, G = X Wg^T, U = X Wu^T, A = silu(G) * U,
    // Y = A Wd^T.
    std::vector<float> xg(pairs * hidden), g(pairs * ffn), u(pairs * ffn), yb_blas(pairs * hidden);
    auto run_blas = [&] {
      for (int64_t p = 0; p < pairs; ++p) {
        std::memcpy(&xg[p * hidden], &x[row_index[p] * hidden], hidden * sizeof(float));
      }
      for (int e = 0; e < num_experts; ++e) {
        const int64_t p0 = offsets[e];
        const int rows = static_cast<int>(offsets[e + 1] - p0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ffn, hidden, 1.0f,
                    &xg[p0 * hidden], hidden, gate[e].data(), hidden, 0.0f, &g[p0 * ffn], ffn);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ffn, hidden, 1.0f,
                    &xg[p0 * hidden], hidden, up[e].data(), hidden, 0.0f, &u[p0 * ffn], ffn);
        for (int64_t i = p0 * ffn; i < (p0 + rows) * ffn; ++i) {
          g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, hidden, ffn, 1.0f, &g[p0 * ffn],
                    ffn, down[e].data(), ffn, 0.0f, &yb_blas[p0 * hidden], hidden);
      }
    };
    const auto [t_epserve, t_blas] = PairedMedianSeconds(run_epserve, run_blas);
    if (failed) return 1;
    std::vector<float> y(pairs * hidden);
    if (!r.Read(*yb, 0, y.data(), y.size() * sizeof(float)).ok()) return 1;
    double diff = 0.0;
    double scale = 0.0;
    for (size_t i = 0; i < y.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(y[i] - yb_blas[i])));
      scale = std::max(scale, static_cast<double>(std::abs(yb_blas[i])));
    }
    const double flops = 6.0 * hidden * ffn * pairs;
    const double gf_epserve = flops / t_epserve / 1e9;
    const double gf_blas = flops / t_blas / 1e9;
    if (m <= 8) {
      // memcpy measured right after, so that it sees the same machine conditions; counted
      // as bytes read plus bytes written per second (twice the bytes copied).
      const double memcpy_best = 2.0 * std::max(MemcpyBytesPerSecond(1), MemcpyBytesPerSecond(2));
      const double bw = weight_bytes / t_epserve;
      std::printf("| %lld | %.3f | %.1f | %.3f | %.1f | %.2f | %.1f | %.1f | %.2f | %.1e |\n",
                  static_cast<long long>(m), t_epserve * 1e3, gf_epserve, t_blas * 1e3, gf_blas,
                  gf_epserve / gf_blas, bw / 1e9, memcpy_best / 1e9, bw / memcpy_best,
                  diff / scale);
    } else {
      std::printf("| %lld | %.3f | %.1f | %.3f | %.1f | %.2f | | | | %.1e |\n",
                  static_cast<long long>(m), t_epserve * 1e3, gf_epserve, t_blas * 1e3, gf_blas,
                  gf_epserve / gf_blas, diff / scale);
    }
    std::fflush(stdout);
  }
  std::printf(
      "\nGFLOP/s count 6*H*F flops per routed row (gate, up, down). Weight GB/s: the %d "
      "experts' weights (%.0f MiB) read once per FFN call / its median time; memcpy "
      "GB/s: the better of 1 and 2 threads, bytes read + bytes written per second (2x the bytes "
      "copied).\n",
      num_experts, weight_bytes / (1 << 20));
  if (getloadavg(load, 3) == 3) {
    std::printf("load average after the run: %.2f %.2f %.2f\n", load[0], load[1], load[2]);
  }
  return 0;
}

}  // namespace
}  // namespace epserve::kernels

int main(int argc, char** argv) {
  epserve::kernels::ReexecWithoutCoretype(argv);
  return epserve::kernels::Run(argc, argv);
}
