#include "shmem/heap.h"

#include <emmintrin.h>
#include <sched.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace epserve::shmem {

absl::Status MpiError(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  int rank = -1;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return absl::InternalError(absl::StrCat(call, " failed on rank ", rank, " at ", file, ":", line,
                                          ": ", absl::string_view(text, len)));
}

absl::StatusOr<std::unique_ptr<SymmetricHeap>> SymmetricHeap::Create(MPI_Comm comm,
                                                                     size_t bytes_per_rank) {
  std::unique_ptr<SymmetricHeap> heap(new SymmetricHeap());
  EPSERVE_MPI_CHECK(MPI_Comm_dup(comm, &heap->comm_));
  EPSERVE_MPI_CHECK(MPI_Comm_rank(heap->comm_, &heap->rank_));
  EPSERVE_MPI_CHECK(MPI_Comm_size(heap->comm_, &heap->num_ranks_));

  // The shm backend needs every rank on this host.
  MPI_Comm node = MPI_COMM_NULL;
  EPSERVE_MPI_CHECK(
      MPI_Comm_split_type(heap->comm_, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  if (node_size != heap->num_ranks_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shared-memory heap needs all ", heap->num_ranks_,
                     " ranks on one host, but only ", node_size, " share this one"));
  }

  // Page-align each segment so device buffers can wrap heap memory directly.
  bytes_per_rank = (bytes_per_rank + 4095) / 4096 * 4096;
  MPI_Info info;
  EPSERVE_MPI_CHECK(MPI_Info_create(&info));
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* local = nullptr;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes_per_rank), 1, info,
                                         heap->comm_, &local, &heap->win_);
  MPI_Info_free(&info);
  EPSERVE_MPI_CHECK(rc);
  heap->bytes_per_rank_ = bytes_per_rank;
  heap->bases_ = std::make_unique<void*[]>(heap->num_ranks_);
  for (int r = 0; r < heap->num_ranks_; ++r) {
    MPI_Aint size = 0;
    int disp = 0;
    EPSERVE_MPI_CHECK(MPI_Win_shared_query(heap->win_, r, &size, &disp, &heap->bases_[r]));
    if (static_cast<size_t>(size) != bytes_per_rank) {
      return absl::InternalError(absl::StrCat("rank ", r, "'s heap segment has ", size,
                                              " bytes, expected ", bytes_per_rank));
    }
  }
  std::memset(local, 0, bytes_per_rank);
  // Everyone's segment is zeroed before anyone signals through it.
  EPSERVE_MPI_CHECK(MPI_Barrier(heap->comm_));
  return heap;
}

SymmetricHeap::~SymmetricHeap() {
  if (win_ != MPI_WIN_NULL) MPI_Win_free(&win_);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
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

absl::Status WaitAtLeast(uint64_t* signal, uint64_t target, absl::Time deadline,
                         absl::string_view what, absl::Duration max_sleep,
                         const std::atomic<bool>* cancel) {
  for (int i = 0; i < 2000; ++i) {
    if (SignalLoad(signal) >= target) return absl::OkStatus();
    _mm_pause();
  }
  absl::Duration sleep = absl::Microseconds(1);
  int yields = 0;
  while (true) {
    const uint64_t seen = SignalLoad(signal);
    if (seen >= target) return absl::OkStatus();
    if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
      return absl::CancelledError(absl::StrCat("cancelled while waiting for ", what));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out waiting for ", what, ": saw ", seen, ", waiting for ", target));
    }
    if (yields < 50) {
      ++yields;
      sched_yield();
    } else {
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(sleep));
      sleep = std::min(sleep * 2, max_sleep);
    }
  }
}

}  // namespace epserve::shmem
