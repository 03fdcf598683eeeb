// The symmetric heap: every rank of a communicator holds a segment of the same size, and
// an offset names the same buffer on every rank. Signals (64-bit words in the heap) carry
// release/acquire ordering between ranks. Only shmem/ knows MPI windows.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace epserve::shmem {

// Status from a failed MPI call, naming the call, file, line and the calling rank.
absl::Status MpiError(int code, const char* call, const char* file, int line);
#define EPSERVE_MPI_CHECK(call)                                              \
  do {                                                                       \
    if (int mpi_rc_ = (call); mpi_rc_ != MPI_SUCCESS)                        \
      return ::epserve::shmem::MpiError(mpi_rc_, #call, __FILE__, __LINE__); \
  } while (0)

// Shared-memory backend: an MPI-3 shared window (MPI_Win_allocate_shared) that every rank
// maps, so loads and stores go straight into a peer's segment. All ranks must share a
// host. Thread-safety: Allocate is not thread-safe; Ptr and the signal functions are.
class SymmetricHeap {
 public:
  // Collective over `comm`: allocates `bytes_per_rank` on every rank, zero-filled.
  static absl::StatusOr<std::unique_ptr<SymmetricHeap>> Create(MPI_Comm comm,
                                                               size_t bytes_per_rank);
  // Collective (MPI_Win_free): every rank must destroy its heap.
  ~SymmetricHeap();

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  size_t bytes_per_rank() const { return bytes_per_rank_; }
  size_t bytes_allocated() const { return next_offset_; }

  // Reserves `bytes` in every rank's segment and returns its offset. Not communication:
  // every rank must make the same calls in the same order, so offsets agree.
  absl::StatusOr<size_t> Allocate(size_t bytes, size_t align = 64);

  // Address of `offset` in `rank`'s segment, valid in this process.
  void* Ptr(int rank, size_t offset) const { return static_cast<char*>(bases_[rank]) + offset; }
  template <typename T>
  T* As(int rank, size_t offset) const {
    return static_cast<T*>(Ptr(rank, offset));
  }

 private:
  SymmetricHeap() = default;
  MPI_Win win_ = MPI_WIN_NULL;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int num_ranks_ = 0;
  size_t bytes_per_rank_ = 0;
  size_t next_offset_ = 0;
  std::unique_ptr<void*[]> bases_;
};

// ---- signals ----
// A signal is a uint64_t in the heap, 8-byte aligned. Stores publish everything the
// storing thread wrote before them (release); loads see it (acquire).

inline void SignalStore(uint64_t* signal, uint64_t value) {
  std::atomic_ref<uint64_t>(*signal).store(value, std::memory_order_release);
}
inline uint64_t SignalLoad(uint64_t* signal) {
  return std::atomic_ref<uint64_t>(*signal).load(std::memory_order_acquire);
}
inline uint64_t SignalAdd(uint64_t* signal, uint64_t delta) {
  return std::atomic_ref<uint64_t>(*signal).fetch_add(delta, std::memory_order_acq_rel) + delta;
}

// Waits until SignalLoad(signal) >= target. Spins briefly, then sleeps with a growing
// backoff (at most max_sleep), so idle ranks leave the cores to busy ones.
// DEADLINE_EXCEEDED names `what`, the value seen and the target when `deadline` passes;
// CANCELLED when `cancel` (optional) turns true first.
absl::Status WaitAtLeast(uint64_t* signal, uint64_t target, absl::Time deadline,
                         absl::string_view what, absl::Duration max_sleep = absl::Microseconds(50),
                         const std::atomic<bool>* cancel = nullptr);

}  // namespace epserve::shmem
