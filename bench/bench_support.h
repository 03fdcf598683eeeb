// What the benchmarks share: their flag checks, OpenBLAS at its best, and median timing
// (round-robin over variants, so that all see the same machine conditions).
#pragma once

#include <dirent.h>
#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "common/proc_stat.h"

namespace epserve::bench {

// Parses a benchmark's flags: -1 to go on, else the exit code: 0 after --help, 2 after a bad
// flag or when valid() is false afterwards (the message and the usage on stderr; `bounds`
// says what valid() asks).
inline int ParseFlags(common::FlagSet& fs, int argc, char** argv,
                      const std::function<bool()>& valid, const char* bounds) {
  const absl::Status s = fs.Parse(argc, argv);
  if (s.ok() && fs.help_requested()) {
    std::printf("%s", fs.Usage().c_str());
    return 0;
  }
  if (s.ok() && valid()) return -1;
  std::fprintf(stderr, "%s\n%s", s.ok() ? bounds : std::string(s.message()).c_str(),
               fs.Usage().c_str());
  return 2;
}

// Whether every entry is at least 1 (and there is one, unless empty_ok).
inline bool AllPositive(const std::vector<int64_t>& v, bool empty_ok = false) {
  return (empty_ok || !v.empty()) &&
         std::all_of(v.begin(), v.end(), [](int64_t x) { return x >= 1; });
}

inline constexpr char kUnsetMarker[] = "EPSERVE_BENCH_UNSET_OPENBLAS_CORETYPE";
// Set by ReexecForUnknownCpu to the core OpenBLAS took the CPU for: its OPENBLAS_CORETYPE
// then stays.
inline constexpr char kUnknownCpuMarker[] = "EPSERVE_BENCH_OPENBLAS_CORE_WAS";

// OpenBLAS reads OPENBLAS_CORETYPE when the library loads (this environment pins it to
// narrower kernels), so drop it and start the binary again. Call first thing in main().
// EPSERVE_BENCH_KEEP_CORETYPE=1 keeps it: to time an older CPU's code on a newer one, with
// PoCL told to build for the same CPU (POCL_LLVM_CPU_NAME=haswell, bench/kernels/RESULTS.md).
inline void ReexecWithoutCoretype(char** argv) {
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  if (coretype == nullptr || std::getenv("EPSERVE_BENCH_KEEP_CORETYPE") != nullptr ||
      std::getenv(kUnknownCpuMarker) != nullptr) {
    return;
  }
  setenv(kUnsetMarker, coretype, 1);
  unsetenv("OPENBLAS_CORETYPE");
  execv("/proc/self/exe", argv);
  std::perror("execv /proc/self/exe");  // carry on with it set; PrintCoretype says so
}

// The OPENBLAS_CORETYPE of this host's widest vectors where OpenBLAS fell back to a core
// without AVX (`corename`: its DYNAMIC_ARCH build does not know every newer CPU; 0.3.21 runs
// Intel's Sapphire Rapids on its Prescott kernels, bench/kernels/RESULTS.md runs 9 and 13),
// else nullptr.
inline const char* CoretypeForUnknownCpu(const char* corename) {
#if defined(__x86_64__)
  static constexpr const char* kWithoutAvx[] = {"Prescott",   "Core2",   "Penryn",
                                                "Dunnington", "Nehalem", "Atom",
                                                "Barcelona",  "Opteron", "Bobcat"};
  bool without_avx = false;
  for (const char* c : kWithoutAvx) without_avx = without_avx || strcasecmp(c, corename) == 0;
  if (!without_avx) return nullptr;
  if (__builtin_cpu_supports("avx512f")) return "SkylakeX";
  if (__builtin_cpu_supports("avx2")) return "Haswell";
#else
  (void)corename;
#endif
  return nullptr;
}

// Call once OpenBLAS is loaded, after ReexecWithoutCoretype: where OpenBLAS took this CPU for
// one without AVX while it has AVX2 or AVX-512, starts the binary again with OPENBLAS_CORETYPE
// naming the kernels of its widest vectors (CoretypeForUnknownCpu), so that the baseline runs
// at its best. EPSERVE_BENCH_KEEP_CORETYPE keeps OpenBLAS's own choice.
inline void ReexecForUnknownCpu(char** argv, const char* corename) {
  if (std::getenv("EPSERVE_BENCH_KEEP_CORETYPE") != nullptr ||
      std::getenv(kUnknownCpuMarker) != nullptr) {
    return;
  }
  const char* coretype = CoretypeForUnknownCpu(corename);
  if (coretype == nullptr) return;
  setenv(kUnknownCpuMarker, corename, 1);
  setenv("OPENBLAS_CORETYPE", coretype, 1);
  execv("/proc/self/exe", argv);
  std::perror("execv /proc/self/exe");  // carry on with OpenBLAS's choice
}

// Says whether OpenBLAS runs with its own kernels.
inline void PrintCoretype() {
  if (const char* core = std::getenv(kUnknownCpuMarker)) {
    std::printf(
        "OpenBLAS took this CPU for one without AVX (core %s): re-executed with "
        "OPENBLAS_CORETYPE=%s, the kernels of its widest vectors\n",
        core, std::getenv("OPENBLAS_CORETYPE"));
  } else if (const char* was = std::getenv(kUnsetMarker)) {
    std::printf("OPENBLAS_CORETYPE=%s was unset (re-executed) so OpenBLAS picks its own kernels\n",
                was);
  } else if (const char* still = std::getenv("OPENBLAS_CORETYPE")) {
    if (std::getenv("EPSERVE_BENCH_KEEP_CORETYPE") != nullptr) {
      std::printf("OPENBLAS_CORETYPE=%s kept (EPSERVE_BENCH_KEEP_CORETYPE)\n", still);
    } else {
      std::printf("WARNING: OPENBLAS_CORETYPE=%s is still set\n", still);
    }
  } else {
    std::printf("OPENBLAS_CORETYPE is not set; OpenBLAS picks its own kernels\n");
  }
}

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median seconds of each of `fns`, timed round-robin (f0, f1, ..., f0, f1, ...) so that all
// see the same machine conditions: `warmup` rounds, then at least min_reps rounds, more
// while the rounds took under min_seconds in total, at most max_reps. *reps (when given)
// receives the number of timed rounds. `settle` (when given) runs, untimed, before each
// timed call, with the index of the function about to be timed.
inline std::vector<double> RoundRobinMedianSeconds(
    const std::vector<std::function<void()>>& fns, int warmup, int min_reps, int max_reps,
    double min_seconds, int* reps_out = nullptr,
    const std::function<void(size_t)>& settle = nullptr) {
  for (int i = 0; i < warmup; ++i) {
    for (const auto& fn : fns) fn();
  }
  std::vector<std::vector<double>> times(fns.size());
  double total = 0.0;
  int reps = 0;
  while (reps < min_reps || (total < min_seconds && reps < max_reps)) {
    for (size_t i = 0; i < fns.size(); ++i) {
      if (settle) settle(i);
      const double t0 = NowSeconds();
      fns[i]();
      times[i].push_back(NowSeconds() - t0);
      total += times[i].back();
    }
    ++reps;
  }
  if (reps_out != nullptr) *reps_out = reps;
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

// Waits, polling every millisecond for at most max_seconds, until no thread of this process
// other than the caller is running or runnable (state R in /proc/self/task/*/stat), and
// returns whether that happened. Used between the timed calls of benchmarks whose baseline
// libraries leave worker threads spinning after a call (OpenBLAS's idle workers call
// sched_yield for 2^28 cycles, about 0.1 s here), so that those spinners do not share the
// cores with whatever is timed next.
inline bool WaitForOtherThreadsIdle(double max_seconds) {
  const std::string self = std::to_string(gettid());
  const double deadline = NowSeconds() + max_seconds;
  while (true) {
    bool busy = false;
    if (DIR* dir = opendir("/proc/self/task")) {
      while (const dirent* entry = readdir(dir)) {
        const std::string tid = entry->d_name;
        if (tid == "." || tid == ".." || tid == self) continue;
        std::ifstream stat("/proc/self/task/" + tid + "/stat");
        std::string line;
        std::getline(stat, line);
        const std::optional<common::ProcStat> p = common::ParseProcStat(line);
        if (p && p->state == 'R') {
          busy = true;
          break;
        }
      }
      closedir(dir);
    }
    if (!busy) return true;
    if (NowSeconds() >= deadline) return false;
    usleep(1000);
  }
}

// Settle hooks for RoundRobinMedianSeconds that wait for the process's other threads to go
// idle (WaitForOtherThreadsIdle, 1 s at most) before the timed calls they mark, counting the
// waits that gave up over a benchmark's whole run.
class IdleThreadsWait {
 public:
  // The hook for one call of RoundRobinMedianSeconds: waits before fns[i] when before[i].
  std::function<void(size_t)> Before(std::vector<bool> before) {
    return [this, before = std::move(before)](size_t i) {
      if (before[i] && !WaitForOtherThreadsIdle(1.0)) ++gave_up_;
    };
  }
  // Prints a warning when some wait gave up: the call after it shared the cores.
  void PrintWarningIfAny() const {
    if (gave_up_ > 0) {
      std::printf(
          "WARNING: %d waits for idle threads before a timed call ended after 1 s with "
          "another thread of this process still running\n",
          gave_up_);
    }
  }

 private:
  int gave_up_ = 0;
};

// Threads kept for a benchmark's whole run, for the parallel baselines it times (a memcpy, a
// plain read): Run(count, fn) runs fn(t) on thread t for t < count and returns when all are
// done. Starting threads inside a timed call would count their start: on a 16-thread host,
// 16 starts and joins are a large share of a read that takes a millisecond. The threads sleep
// on a condition variable between runs (no spinning: IdleThreadsWait sees them idle).
class ThreadTeam {
 public:
  explicit ThreadTeam(int size) {
    for (int t = 0; t < size; ++t) threads_.emplace_back([this, t] { Serve(t); });
  }
  ~ThreadTeam() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& th : threads_) th.join();
  }
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }

  // count: 1 to size().
  void Run(int count, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> lock(mu_);
    fn_ = &fn;
    count_ = std::clamp(count, 1, size());
    pending_ = count_;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void Serve(int t) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (t >= count_) continue;
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      (*fn)(t);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void(int)>* fn_ = nullptr;
  int count_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Median seconds of one function, timed as RoundRobinMedianSeconds times each variant.
inline double MedianSeconds(std::function<void()> fn, int warmup, int min_reps, int max_reps,
                            double min_seconds, int* reps_out = nullptr) {
  return RoundRobinMedianSeconds({std::move(fn)}, warmup, min_reps, max_reps, min_seconds,
                                 reps_out)[0];
}

// Prints the 1/5/15-minute load averages and the online core count, "before" or "after" the
// run: figures from a busy machine are worth less.
inline void PrintLoadAverage(const char* when) {
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) {
    std::printf("load average %s the run: %.2f %.2f %.2f (%ld cores)\n", when, load[0], load[1],
                load[2], sysconf(_SC_NPROCESSORS_ONLN));
  }
}

// The host's CPU model and the vector extensions it has of those that decide kernel speed
// (x86: SSE4.2 to AVX-512 with BF16/VNNI and AMX; Arm: NEON as asimd, SVE, BF16), from
// /proc/cpuinfo: "cpu: AMD EPYC 7B13 | avx avx2 fma f16c".
inline std::string HostIsa() {
  static const char* const kInteresting[] = {
      "sse4_2",   "avx",         "avx2",        "fma",         "f16c",     "avx512f",  "avx512bw",
      "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd",
      "asimdhp",  "sve",         "sve2",        "bf16",        "i8mm"};
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown", flags;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if ((key == "model name" || key == "Model") && model == "unknown") model = value;
    if ((key == "flags" || key == "Features") && flags.empty()) flags = " " + value + " ";
  }
  std::string have;
  for (const char* f : kInteresting) {
    if (flags.find(std::string(" ") + f + " ") != std::string::npos) {
      have += have.empty() ? f : std::string(" ") + f;
    }
  }
  return "cpu: " + model + " | " + (have.empty() ? "(none of the listed extensions)" : have);
}

}  // namespace epserve::bench
