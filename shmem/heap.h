// The symmetric heap: every rank of a communicator holds a segment of the same size, and
// an offset names the same buffer on every rank. Two backends behind one interface:
//   shm  an MPI-3 shared window (MPI_Win_allocate_shared): every rank maps every peer's
//        segment, Put is a memcpy and a signal is an atomic store. All ranks on one host.
//   rma  MPI one-sided RMA (MPI_Win_allocate, passive target, lock_all): Put is MPI_Put,
//        signals are MPI_Accumulate / MPI_Fetch_and_op, completed with MPI_Win_flush.
//        Works across hosts, and on one host too.
// Signals are 64-bit words in the heap with release/acquire ordering: once a rank sees a
// signal value, it sees every Put the signalling rank issued to it before setting it.
// Only shmem/ knows MPI windows.
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
// For an MPI call whose caller cannot return a Status (a destructor, teardown) or goes on
// regardless (a hint): logs the failure (common/log.h) as MpiError words it, and goes on.
void LogMpiError(int code, const char* call, const char* file, int line);
#define EPSERVE_MPI_CHECK_LOG(call)                                      \
  do {                                                                   \
    if (int mpi_rc_ = (call); mpi_rc_ != MPI_SUCCESS)                    \
      ::epserve::shmem::LogMpiError(mpi_rc_, #call, __FILE__, __LINE__); \
  } while (0)

enum class HeapBackend { kAuto, kShm, kRma };
// "auto", "shm" or "rma"; anything else is INVALID_ARGUMENT naming `--heap`.
absl::StatusOr<HeapBackend> ParseHeapBackend(absl::string_view name);
const char* HeapBackendName(HeapBackend backend);

// How a wait spins before it sleeps. The defaults suit a rank that owns a core.
struct WaitOptions {
  absl::Duration max_sleep = absl::Microseconds(50);  // longest sleep between two polls
  // When > 0, a long wait may also sleep up to this fraction of the time it has waited so
  // far: a wait of T polls O(log T / fraction) times instead of T / max_sleep, and notices
  // the signal at most about fraction * T late. For waits that routinely last milliseconds.
  double sleep_fraction = 0;
  const std::atomic<bool>* cancel = nullptr;  // CANCELLED once it turns true
  // CANCELLED once the word at cancel_signal (a signal in this rank's own memory, stored
  // with SignalStore) exceeds cancel_above: how rank 0 ends a batch's waits on every worker
  // at once when a peer of theirs died.
  const uint64_t* cancel_signal = nullptr;
  uint64_t cancel_above = 0;
};

// Thread-safety: Allocate is not thread-safe. The data and signal functions may be called
// from one thread at a time per heap (the rma backend calls MPI; the process must be
// initialised with at least MPI_THREAD_SERIALIZED if that thread is not the main one).
class SymmetricHeap {
 public:
  // Collective over `comm`: allocates `bytes_per_rank` (rounded up to a page) on every
  // rank, zero-filled. kAuto picks shm when every rank shares this host, else rma. shm
  // with ranks on several hosts is FAILED_PRECONDITION.
  static absl::StatusOr<std::unique_ptr<SymmetricHeap>> Create(
      MPI_Comm comm, size_t bytes_per_rank, HeapBackend backend = HeapBackend::kAuto);
  // Collective (MPI_Win_free): every rank must destroy its heap.
  virtual ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  HeapBackend backend() const { return backend_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  size_t bytes_per_rank() const { return bytes_per_rank_; }
  size_t bytes_allocated() const { return next_offset_; }

  // Reserves `bytes` in every rank's segment and returns its offset. Not communication:
  // every rank must make the same calls in the same order, so offsets agree.
  absl::StatusOr<size_t> Allocate(size_t bytes, size_t align = 64);

  // This rank's own segment, for loads and stores (what peers Put here is visible once
  // a signal announcing it has been seen by SignalLoad/WaitSignal).
  void* Local(size_t offset) const { return local_ + offset; }
  template <typename T>
  T* LocalAs(size_t offset) const {
    return reinterpret_cast<T*>(local_ + offset);
  }
  // Load/store address of `offset` in `rank`'s segment, or nullptr when the backend has
  // no load/store path there (rma: every rank but this one). Stores through it count as
  // Puts for the signal ordering.
  virtual void* Direct(int rank, size_t offset) const = 0;
  template <typename T>
  T* DirectAs(int rank, size_t offset) const {
    return static_cast<T*>(Direct(rank, offset));
  }

  // Copies `bytes` from `src` into `rank`'s segment at `offset`. May complete later: `src`
  // must stay unchanged until the next Flush or SignalSet towards `rank`.
  virtual absl::Status Put(int rank, size_t offset, const void* src, size_t bytes) = 0;
  // Completes every Put issued to `rank` (src buffers may be reused; data is there).
  virtual absl::Status Flush(int rank) = 0;
  // Blocking copy from `rank`'s segment.
  virtual absl::Status Get(int rank, size_t offset, void* dst, size_t bytes) = 0;

  // ---- signals: uint64 words, 8-byte aligned offsets ----
  // Completes every Put to `rank` and makes this rank's stores into its own segment visible
  // to peers' Gets, then stores `value` into `rank`'s signal (release).
  virtual absl::Status SignalSet(int rank, size_t offset, uint64_t value) = 0;
  // Atomically adds `delta` to `rank`'s signal (after completing Puts to it); returns the
  // new value.
  virtual absl::StatusOr<uint64_t> SignalAdd(int rank, size_t offset, uint64_t delta) = 0;
  // Reads a signal of this rank's own segment (acquire). On an MPI failure returns 0 and
  // keeps the error for the next WaitSignal.
  virtual uint64_t SignalLoad(size_t offset) = 0;
  // Waits until this rank's signal at `offset` is >= `target`. DEADLINE_EXCEEDED names
  // `what` (and `index` when >= 0), the value seen and the target when `deadline` passes.
  absl::Status WaitSignal(size_t offset, uint64_t target, absl::Time deadline,
                          absl::string_view what, int index = -1, const WaitOptions& wait = {});

 protected:
  SymmetricHeap() = default;
  // Error of the last failed SignalLoad, if any (cleared when read).
  absl::Status TakeLoadError();
  HeapBackend backend_ = HeapBackend::kShm;
  MPI_Win win_ = MPI_WIN_NULL;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int num_ranks_ = 0;
  size_t bytes_per_rank_ = 0;
  size_t next_offset_ = 0;
  char* local_ = nullptr;
  absl::Status load_error_;
};

// ---- signals through plain memory (the shm backend, and tests) ----
// Stores publish everything the storing thread wrote before them (release); loads see it
// (acquire).

inline void SignalStore(uint64_t* signal, uint64_t value) {
  std::atomic_ref<uint64_t>(*signal).store(value, std::memory_order_release);
}
inline uint64_t SignalLoad(uint64_t* signal) {
  return std::atomic_ref<uint64_t>(*signal).load(std::memory_order_acquire);
}
inline uint64_t SignalAdd(uint64_t* signal, uint64_t delta) {
  return std::atomic_ref<uint64_t>(*signal).fetch_add(delta, std::memory_order_acq_rel) + delta;
}

// Waits until SignalLoad(signal) >= target, like SymmetricHeap::WaitSignal. Spins briefly,
// then yields, then sleeps with a growing backoff (at most wait.max_sleep), so idle ranks
// leave the cores to busy ones.
absl::Status WaitAtLeast(uint64_t* signal, uint64_t target, absl::Time deadline,
                         absl::string_view what, absl::Duration max_sleep = absl::Microseconds(50),
                         const std::atomic<bool>* cancel = nullptr);
absl::Status WaitAtLeast(uint64_t* signal, uint64_t target, absl::Time deadline,
                         absl::string_view what, const WaitOptions& wait);

}  // namespace epserve::shmem
