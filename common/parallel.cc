#include "common/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace epserve::common {

int DefaultCopyThreads() {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw / 4, 1, 8);
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
  size_t total = 0;
  for (const CopyJob& j : jobs) total += j.bytes;
  // Thread r copies bytes [total * r / ranges, total * (r + 1) / ranges) of the concatenation.
  ParallelFor(threads, static_cast<int64_t>(total), int64_t{1} << 20,
              [&](int64_t begin, int64_t end) {
                size_t at = 0;  // where job j starts in the concatenation
                for (const CopyJob& j : jobs) {
                  const size_t from = std::max<size_t>(begin, at);
                  const size_t to = std::min<size_t>(end, at + j.bytes);
                  if (from < to) {
                    std::memcpy(static_cast<char*>(j.dst) + (from - at),
                                static_cast<const char*>(j.src) + (from - at), to - from);
                  }
                  at += j.bytes;
                  if (at >= static_cast<size_t>(end)) break;
                }
              });
}

}  // namespace epserve::common
