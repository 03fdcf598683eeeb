// Data-parallel loops for rank 0's per-row work (copies of a batch's rows into and out of the
// heap, dtype conversions): a batch of 4096 rows x 2048 floats is 32 MiB, which one thread
// copies in several milliseconds, on the critical path of every batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

namespace epserve::common {

// Host threads for rank 0's row copies when not forced: a quarter of the host's hardware
// threads (the workers and gRPC keep the rest), at least 1, at most 8 (beyond that a copy is
// bound by memory bandwidth). 1 on a 2-core machine: no threads at all.
int DefaultCopyThreads();

// Whether the host has hardware threads to spare for polling: at least 4 for each of the
// `ranks_on_host` ranks of the job on it. Where it has, a rank's polls (an idle worker's look
// for the next batch, rank 0's look at a running batch's end) can be short; where it has not,
// each poll takes time from the cores the workers compute on.
bool ThreadsToSpare(int ranks_on_host);

// Makes the calling thread's timed sleeps and waits end within about a microsecond of their
// time instead of Linux's default timer slack of 50 us, which otherwise comes on top of every
// poll that sleeps (a decode-sized batch lasts a fraction of a millisecond). Once per thread.
void SleepPrecisely();

// Runs fn(begin, end) over [0, n) split into at most `threads` contiguous ranges of at least
// `min_grain` items (fewer ranges where n is small), the first range on the calling thread,
// the others on threads started for the call; returns when every range is done. threads <= 1
// or n < 2 * min_grain: one call on this thread.
void ParallelFor(int threads, int64_t n, int64_t min_grain,
                 const std::function<void(int64_t begin, int64_t end)>& fn);

// Names the calling thread (at most 15 characters are kept): what `top -H`, `ps -L` and
// /proc/PID/task/TID/comm show, so that a rank's CPU time can be told apart by thread.
// Every long-lived thread of epserve's own is named "ep-<role>"; ParallelFor's are "ep-copy".
void NameThisThread(const char* name);

// Runs part(job, from, to) over the items [from, to) of each job of `jobs` (job j holds
// size(j) items) such that the concatenation of the jobs' items is split into at most
// `threads` contiguous ranges of at least `min_grain` items (ParallelFor): how a list of
// copies or conversions is spread evenly over threads whatever the jobs' sizes.
template <typename Job, typename Size, typename Part>
void ParallelOverJobs(int threads, std::span<const Job> jobs, int64_t min_grain, Size size,
                      Part part) {
  int64_t total = 0;
  for (const Job& j : jobs) total += static_cast<int64_t>(size(j));
  ParallelFor(threads, total, min_grain, [&](int64_t begin, int64_t end) {
    int64_t at = 0;  // where job j starts in the concatenation
    for (const Job& j : jobs) {
      const int64_t n = static_cast<int64_t>(size(j));
      const int64_t from = begin > at ? begin : at;
      const int64_t to = end < at + n ? end : at + n;
      if (from < to) part(j, static_cast<size_t>(from - at), static_cast<size_t>(to - at));
      at += n;
      if (at >= end) break;
    }
  });
}

// One copy of a list of copies.
struct CopyJob {
  void* dst;
  const void* src;
  size_t bytes;
};
// The copies of `jobs` (non-overlapping), their bytes split evenly over up to `threads`
// threads, at least 1 MiB each.
void ParallelCopy(int threads, std::span<const CopyJob> jobs);

}  // namespace epserve::common
