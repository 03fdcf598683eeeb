#include "common/parallel.h"

#include <pthread.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace epserve::common {

int DefaultCopyThreads() {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw / 4, 1, 8);
}

bool ThreadsToSpare(int ranks_on_host) {
  return static_cast<int>(std::thread::hardware_concurrency()) >= 4 * std::max(ranks_on_host, 1);
}

void SleepPrecisely() {
#if defined(__linux__)
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  // nanoseconds
#endif
}

void NameThisThread(const char* name) {
  char shortened[16];
  std::strncpy(shortened, name, sizeof(shortened) - 1);
  shortened[sizeof(shortened) - 1] = '\0';
  pthread_setname_np(pthread_self(), shortened);
}

void ParallelFor(int threads, int64_t n, int64_t min_grain,
                 const std::function<void(int64_t begin, int64_t end)>& fn) {
  if (n <= 0) return;
  const int64_t grain = std::max<int64_t>(min_grain, 1);
  const int64_t ranges = std::clamp<int64_t>(n / grain, 1, std::max(threads, 1));
  if (ranges == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> helpers;
  helpers.reserve(ranges - 1);
  for (int64_t r = 1; r < ranges; ++r) {
    helpers.emplace_back([&fn, r, ranges, n] {
      NameThisThread("ep-copy");
      fn(n * r / ranges, n * (r + 1) / ranges);
    });
  }
  fn(0, n / ranges);
  for (std::thread& t : helpers) t.join();
}

void ParallelCopy(int threads, std::span<const CopyJob> jobs) {
  ParallelOverJobs(
      threads, jobs, int64_t{1} << 20, [](const CopyJob& j) { return j.bytes; },
      [](const CopyJob& j, size_t from, size_t to) {
        std::memcpy(static_cast<char*>(j.dst) + from, static_cast<const char*>(j.src) + from,
                    to - from);
      });
}

}  // namespace epserve::common
