// The rma backend: MPI_Win_allocate with one passive-target epoch (lock_all) for the
// heap's lifetime. Put is MPI_Put; MPI_Win_flush gives remote completion, which orders a
// signal after the data it announces; signals are MPI_Accumulate(MPI_REPLACE),
// MPI_Fetch_and_op(MPI_SUM) and, for local polls, MPI_Fetch_and_op(MPI_NO_OP) on this
// rank followed by MPI_Win_sync, so that the plain loads of Local() that follow see what
// peers put (and so that transports needing target-side progress get it while polling).
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "shmem/detail/backends.h"

namespace epserve::shmem::detail {
namespace {

// MPI counts are ints: large transfers go in pieces of at most 1 GiB.
constexpr size_t kMaxPiece = size_t{1} << 30;

class RmaHeap final : public SymmetricHeap {
 public:
  static absl::StatusOr<std::unique_ptr<SymmetricHeap>> Create(MPI_Comm comm, size_t bytes);
  ~RmaHeap() override {
    if (win_ != MPI_WIN_NULL) {
      if (locked_) EPSERVE_MPI_CHECK_LOG(MPI_Win_unlock_all(win_));
      EPSERVE_MPI_CHECK_LOG(MPI_Win_free(&win_));
    }
  }

  void* Direct(int rank, size_t offset) const override {
    return rank == rank_ ? Local(offset) : nullptr;
  }
  absl::Status Put(int rank, size_t offset, const void* src, size_t bytes) override {
    if (rank == rank_) {
      std::memcpy(Local(offset), src, bytes);
      return absl::OkStatus();
    }
    for (size_t done = 0; done < bytes;) {
      const int piece = static_cast<int>(std::min(kMaxPiece, bytes - done));
      EPSERVE_MPI_CHECK(MPI_Put(static_cast<const char*>(src) + done, piece, MPI_BYTE, rank,
                                static_cast<MPI_Aint>(offset + done), piece, MPI_BYTE, win_));
      done += static_cast<size_t>(piece);
    }
    return absl::OkStatus();
  }
  absl::Status Flush(int rank) override {
    if (rank == rank_) return absl::OkStatus();
    EPSERVE_MPI_CHECK(MPI_Win_flush(rank, win_));
    return absl::OkStatus();
  }
  absl::Status Get(int rank, size_t offset, void* dst, size_t bytes) override {
    if (rank == rank_) {
      EPSERVE_MPI_CHECK(MPI_Win_sync(win_));
      std::memcpy(dst, Local(offset), bytes);
      return absl::OkStatus();
    }
    for (size_t done = 0; done < bytes;) {
      const int piece = static_cast<int>(std::min(kMaxPiece, bytes - done));
      EPSERVE_MPI_CHECK(MPI_Get(static_cast<char*>(dst) + done, piece, MPI_BYTE, rank,
                                static_cast<MPI_Aint>(offset + done), piece, MPI_BYTE, win_));
      done += static_cast<size_t>(piece);
    }
    EPSERVE_MPI_CHECK(MPI_Win_flush(rank, win_));
    return absl::OkStatus();
  }
  absl::Status SignalSet(int rank, size_t offset, uint64_t value) override {
    // This rank's stores into its own segment before it, for peers that Get after the signal.
    EPSERVE_MPI_CHECK(MPI_Win_sync(win_));
    EPSERVE_MPI_CHECK(MPI_Win_flush(rank, win_));
    EPSERVE_MPI_CHECK(MPI_Accumulate(&value, 1, MPI_UINT64_T, rank, static_cast<MPI_Aint>(offset),
                                     1, MPI_UINT64_T, MPI_REPLACE, win_));
    EPSERVE_MPI_CHECK(MPI_Win_flush(rank, win_));
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> SignalAdd(int rank, size_t offset, uint64_t delta) override {
    if (rank == rank_) EPSERVE_MPI_CHECK(MPI_Win_sync(win_));
    EPSERVE_MPI_CHECK(MPI_Win_flush(rank, win_));
    uint64_t old = 0;
    EPSERVE_MPI_CHECK(MPI_Fetch_and_op(&delta, &old, MPI_UINT64_T, rank,
                                       static_cast<MPI_Aint>(offset), MPI_SUM, win_));
    EPSERVE_MPI_CHECK(MPI_Win_flush(rank, win_));
    return old + delta;
  }
  uint64_t SignalLoad(size_t offset) override {
    uint64_t value = 0;
    int rc = MPI_Fetch_and_op(nullptr, &value, MPI_UINT64_T, rank_, static_cast<MPI_Aint>(offset),
                              MPI_NO_OP, win_);
    if (rc == MPI_SUCCESS) rc = MPI_Win_flush(rank_, win_);
    if (rc == MPI_SUCCESS) rc = MPI_Win_sync(win_);
    if (rc != MPI_SUCCESS) {
      load_error_ = MpiError(rc, "MPI_Fetch_and_op(MPI_NO_OP)", __FILE__, __LINE__);
      return 0;
    }
    return value;
  }

 private:
  bool locked_ = false;
};

absl::StatusOr<std::unique_ptr<SymmetricHeap>> RmaHeap::Create(MPI_Comm comm, size_t bytes) {
  std::unique_ptr<RmaHeap> heap(new RmaHeap());
  heap->comm_ = comm;
  heap->backend_ = HeapBackend::kRma;
  EPSERVE_MPI_CHECK(MPI_Comm_rank(comm, &heap->rank_));
  EPSERVE_MPI_CHECK(MPI_Comm_size(comm, &heap->num_ranks_));
  if (bytes > static_cast<size_t>(std::numeric_limits<MPI_Aint>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("heap segment of ", bytes, " bytes too large"));
  }
  MPI_Info info;
  EPSERVE_MPI_CHECK(MPI_Info_create(&info));
  // Hints: without them every rank still reaches the collective allocation below.
  EPSERVE_MPI_CHECK_LOG(MPI_Info_set(info, "same_size", "true"));
  EPSERVE_MPI_CHECK_LOG(MPI_Info_set(info, "same_disp_unit", "true"));
  void* local = nullptr;
  const int rc = MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, info, comm, &local, &heap->win_);
  EPSERVE_MPI_CHECK_LOG(MPI_Info_free(&info));
  EPSERVE_MPI_CHECK(rc);
  EPSERVE_MPI_CHECK(MPI_Win_set_errhandler(heap->win_, MPI_ERRORS_RETURN));
  heap->bytes_per_rank_ = bytes;
  heap->local_ = static_cast<char*>(local);
  std::memset(local, 0, bytes);
  EPSERVE_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, heap->win_));
  heap->locked_ = true;
  EPSERVE_MPI_CHECK(MPI_Win_sync(heap->win_));
  EPSERVE_MPI_CHECK(MPI_Barrier(comm));
  return std::unique_ptr<SymmetricHeap>(std::move(heap));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SymmetricHeap>> CreateRmaHeap(MPI_Comm comm, size_t bytes) {
  return RmaHeap::Create(comm, bytes);
}

}  // namespace epserve::shmem::detail
