// Exclusive advisory locks on files (flock) between the processes of one host: the FFN
// tuner's locks beside its cache entries. Private to kernels/.
#pragma once

#include <string>

namespace epserve::kernels::detail {

// An exclusive flock on the file at a path (created when missing), held until Release or
// destruction. A lock is advice: one that was not taken (the file could not be opened, or the
// wait ran out) is simply not held, and the caller goes on without it. Two FileLocks on one
// path exclude each other within a process too (each opens its own file description).
// Move-only; one thread owns a FileLock.
class FileLock {
 public:
  FileLock() = default;
  // Waits up to max_wait_seconds for the lock (0: one try); an empty path takes nothing.
  FileLock(const std::string& path, double max_wait_seconds);
  FileLock(FileLock&& o) noexcept;
  FileLock& operator=(FileLock&& o) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock() { Release(); }

  bool held() const { return fd_ >= 0; }
  // Whether the lock was not taken because another holder kept it through the wait (not
  // because the file could not be opened).
  bool busy() const { return busy_; }
  void Release();

 private:
  int fd_ = -1;
  bool busy_ = false;
};

}  // namespace epserve::kernels::detail
