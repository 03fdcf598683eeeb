#include "shmem/heap.h"

#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"
#include "common/parallel.h"
#include "shmem/detail/backends.h"
#include "shmem/host.h"

namespace epserve::shmem {

absl::Status MpiError(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  // The rank, where MPI can still tell it (between MPI_Init and MPI_Finalize); else -1.
  int rank = -1;
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS) initialized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS) finalized = 1;
  if (initialized && !finalized && MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS) rank = -1;
  return absl::InternalError(absl::StrCat(call, " failed on rank ", rank, " at ", file, ":", line,
                                          ": ", absl::string_view(text, len)));
}

void LogMpiError(int code, const char* call, const char* file, int line) {
  common::LogError(std::string(MpiError(code, call, file, line).message()));
}

absl::StatusOr<HeapBackend> ParseHeapBackend(absl::string_view name) {
  if (name == "auto") return HeapBackend::kAuto;
  if (name == "shm") return HeapBackend::kShm;
  if (name == "rma") return HeapBackend::kRma;
  return absl::InvalidArgumentError(
      absl::StrCat("--heap must be auto, shm or rma, got '", name, "'"));
}

const char* HeapBackendName(HeapBackend backend) {
  switch (backend) {
    case HeapBackend::kAuto:
      return "auto";
    case HeapBackend::kShm:
      return "shm";
    case HeapBackend::kRma:
      return "rma";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<SymmetricHeap>> SymmetricHeap::Create(MPI_Comm comm,
                                                                     size_t bytes_per_rank,
                                                                     HeapBackend backend) {
  MPI_Comm dup = MPI_COMM_NULL;
  EPSERVE_MPI_CHECK(MPI_Comm_dup(comm, &dup));
  int num_ranks = 0;
  EPSERVE_MPI_CHECK(MPI_Comm_size(dup, &num_ranks));
  // Whether every rank shares this host: the same answer on every rank.
  absl::StatusOr<std::vector<int>> on_host = RanksOnThisHost(dup);
  if (!on_host.ok()) {
    EPSERVE_MPI_CHECK_LOG(MPI_Comm_free(&dup));
    return on_host.status();
  }
  const int node_size = static_cast<int>(on_host->size());
  int all_local = node_size == num_ranks ? 1 : 0;
  EPSERVE_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &all_local, 1, MPI_INT, MPI_MIN, dup));
  if (backend == HeapBackend::kAuto) backend = all_local ? HeapBackend::kShm : HeapBackend::kRma;
  if (backend == HeapBackend::kShm && !all_local) {
    EPSERVE_MPI_CHECK_LOG(MPI_Comm_free(&dup));  // the error below is the one to return
    return absl::FailedPreconditionError(
        absl::StrCat("--heap=shm needs all ", num_ranks, " ranks on one host, but only ", node_size,
                     " share this one; use --heap=rma or --heap=auto"));
  }
  // Page-align each segment so device buffers can wrap heap memory directly.
  bytes_per_rank = std::max<size_t>((bytes_per_rank + 4095) / 4096 * 4096, 4096);
  return backend == HeapBackend::kShm ? detail::CreateShmHeap(dup, bytes_per_rank)
                                      : detail::CreateRmaHeap(dup, bytes_per_rank);
}

SymmetricHeap::~SymmetricHeap() {
  if (comm_ != MPI_COMM_NULL) EPSERVE_MPI_CHECK_LOG(MPI_Comm_free(&comm_));
}

absl::StatusOr<size_t> SymmetricHeap::Allocate(size_t bytes, size_t align) {
  if (align == 0 || (align & (align - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("alignment must be a power of two, got ", align));
  }
  const size_t offset = (next_offset_ + align - 1) / align * align;
  if (offset + bytes > bytes_per_rank_) {
    return absl::ResourceExhaustedError(absl::StrCat("symmetric heap full: ", bytes,
                                                     " bytes requested at offset ", offset, " of ",
                                                     bytes_per_rank_, " per rank"));
  }
  next_offset_ = offset + bytes;
  return offset;
}

absl::Status SymmetricHeap::TakeLoadError() {
  absl::Status s = std::move(load_error_);
  load_error_ = absl::OkStatus();
  return s;
}

namespace {

// One step of a spin wait: tells the core this is a spin (frees the sibling hyperthread,
// avoids the memory-order flush on exit) where the instruction set has a way to say so.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// Once per thread (the first wait that sleeps): common::SleepPrecisely.
bool PreciseSleeps() {
  common::SleepPrecisely();
  return true;
}

// The wait loop shared by both waits: spin, then yield, then sleep with backoff.
template <typename Load>
absl::Status WaitLoop(Load load, uint64_t target, absl::Time deadline, absl::string_view what,
                      int index, const WaitOptions& wait) {
  for (int i = 0; i < 256; ++i) {
    if (load() >= target) return absl::OkStatus();
    CpuRelax();
  }
  absl::Duration sleep = absl::Microseconds(1);
  const absl::Time start = absl::Now();
  int yields = 0;
  while (true) {
    const uint64_t seen = load();
    if (seen >= target) return absl::OkStatus();
    if ((wait.cancel != nullptr && wait.cancel->load(std::memory_order_relaxed)) ||
        (wait.cancel_signal != nullptr &&
         SignalLoad(const_cast<uint64_t*>(wait.cancel_signal)) > wait.cancel_above)) {
      return absl::CancelledError(absl::StrCat("cancelled while waiting for ", what,
                                               index >= 0 ? " " : "",
                                               index >= 0 ? absl::StrCat(index) : ""));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "timed out waiting for ", what, index >= 0 ? " " : "",
          index >= 0 ? absl::StrCat(index) : "", ": saw ", seen, ", waiting for ", target));
    }
    if (yields < 200) {
      ++yields;
      sched_yield();
    } else {
      static thread_local const bool precise = PreciseSleeps();
      (void)precise;
      // Never past the deadline, which a sleep proportional to the wait could overshoot.
      std::this_thread::sleep_for(
          absl::ToChronoNanoseconds(std::min(sleep, deadline - absl::Now())));
      absl::Duration cap = wait.max_sleep;
      if (wait.sleep_fraction > 0) cap = std::max(cap, (absl::Now() - start) * wait.sleep_fraction);
      sleep = std::min(sleep * 2, cap);
    }
  }
}

}  // namespace

absl::Status SymmetricHeap::WaitSignal(size_t offset, uint64_t target, absl::Time deadline,
                                       absl::string_view what, int index, const WaitOptions& wait) {
  absl::Status s =
      WaitLoop([&] { return SignalLoad(offset); }, target, deadline, what, index, wait);
  absl::Status load = TakeLoadError();
  return load.ok() ? s : load;
}

absl::Status WaitAtLeast(uint64_t* signal, uint64_t target, absl::Time deadline,
                         absl::string_view what, absl::Duration max_sleep,
                         const std::atomic<bool>* cancel) {
  WaitOptions wait;
  wait.max_sleep = max_sleep;
  wait.cancel = cancel;
  return WaitAtLeast(signal, target, deadline, what, wait);
}

absl::Status WaitAtLeast(uint64_t* signal, uint64_t target, absl::Time deadline,
                         absl::string_view what, const WaitOptions& wait) {
  return WaitLoop([signal] { return SignalLoad(signal); }, target, deadline, what, -1, wait);
}

}  // namespace epserve::shmem
