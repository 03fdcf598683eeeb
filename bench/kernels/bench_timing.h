// What the kernel benchmarks share: OpenBLAS at its best, and round-robin median timing.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace epserve::kernels::bench {

inline constexpr char kUnsetMarker[] = "EPSERVE_BENCH_UNSET_OPENBLAS_CORETYPE";

// OpenBLAS reads OPENBLAS_CORETYPE when the library loads (this environment pins it to
// narrower kernels), so drop it and start the binary again. Call first thing in main().
inline void ReexecWithoutCoretype(char** argv) {
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if (coretype == nullptr) return;
  setenv(kUnsetMarker, coretype, 1);
  unsetenv("OPENBLAS_CORETYPE");
  execv("/proc/self/exe", argv);
  std::perror("execv /proc/self/exe");  // carry on with it set; PrintCoretype says so
}

// Says whether OpenBLAS runs with its own kernels.
inline void PrintCoretype() {
  if (const char* was = std::getenv(kUnsetMarker)) {
    std::printf("OPENBLAS_CORETYPE=%s was unset (re-executed) so OpenBLAS picks its own kernels\n",
                was);
  } else if (const char* still = std::getenv("OPENBLAS_CORETYPE")) {
    std::printf("WARNING: OPENBLAS_CORETYPE=%s is still set\n", still);
  } else {
    std::printf("OPENBLAS_CORETYPE is not set; OpenBLAS picks its own kernels\n");
  }
}

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median seconds of each of `fns`, timed round-robin (f0, f1, ..., f0, f1, ...) so that all
// see the same machine conditions: `warmup` rounds, then at least min_reps rounds, more
// while the rounds took under min_seconds in total, at most max_reps.
inline std::vector<double> RoundRobinMedianSeconds(const std::vector<std::function<void()>>& fns,
                                                   int warmup, int min_reps, int max_reps,
                                                   double min_seconds) {
  for (int i = 0; i < warmup; ++i) {
    for (const auto& fn : fns) fn();
  }
  std::vector<std::vector<double>> times(fns.size());
  double total = 0.0;
  int reps = 0;
  while (reps < min_reps || (total < min_seconds && reps < max_reps)) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const double t0 = NowSeconds();
      fns[i]();
      times[i].push_back(NowSeconds() - t0);
      total += times[i].back();
    }
    ++reps;
  }
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

}  // namespace epserve::kernels::bench
