// The shm backend: an MPI-3 shared window that every rank maps. Put is a memcpy into the
// peer's mapping, signals are atomic stores and loads; nothing goes through MPI after
// creation.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "shmem/detail/backends.h"

namespace epserve::shmem::detail {
namespace {

class ShmHeap final : public SymmetricHeap {
 public:
  static absl::StatusOr<std::unique_ptr<SymmetricHeap>> Create(MPI_Comm comm, size_t bytes);
  ~ShmHeap() override {
    if (win_ != MPI_WIN_NULL) EPSERVE_MPI_CHECK_LOG(MPI_Win_free(&win_));
  }

  void* Direct(int rank, size_t offset) const override {
    return static_cast<char*>(bases_[rank]) + offset;
  }
  absl::Status Put(int rank, size_t offset, const void* src, size_t bytes) override {
    std::memcpy(Direct(rank, offset), src, bytes);
    return absl::OkStatus();
  }
  absl::Status Flush(int) override { return absl::OkStatus(); }
  absl::Status Get(int rank, size_t offset, void* dst, size_t bytes) override {
    std::memcpy(dst, Direct(rank, offset), bytes);
    return absl::OkStatus();
  }
  absl::Status SignalSet(int rank, size_t offset, uint64_t value) override {
    SignalStore(DirectAs<uint64_t>(rank, offset), value);
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> SignalAdd(int rank, size_t offset, uint64_t delta) override {
    return shmem::SignalAdd(DirectAs<uint64_t>(rank, offset), delta);
  }
  uint64_t SignalLoad(size_t offset) override {
    return shmem::SignalLoad(LocalAs<uint64_t>(offset));
  }

 private:
  std::unique_ptr<void*[]> bases_;
};

absl::StatusOr<std::unique_ptr<SymmetricHeap>> ShmHeap::Create(MPI_Comm comm, size_t bytes) {
  std::unique_ptr<ShmHeap> heap(new ShmHeap());
  heap->comm_ = comm;  // freed by ~SymmetricHeap from here on
  heap->backend_ = HeapBackend::kShm;
  EPSERVE_MPI_CHECK(MPI_Comm_rank(comm, &heap->rank_));
  EPSERVE_MPI_CHECK(MPI_Comm_size(comm, &heap->num_ranks_));
  MPI_Info info;
  EPSERVE_MPI_CHECK(MPI_Info_create(&info));
  // A hint: without it every rank still reaches the collective allocation below.
  EPSERVE_MPI_CHECK_LOG(MPI_Info_set(info, "alloc_shared_noncontig", "true"));
  void* local = nullptr;
  const int rc =
      MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, comm, &local, &heap->win_);
  EPSERVE_MPI_CHECK_LOG(MPI_Info_free(&info));
  EPSERVE_MPI_CHECK(rc);
  heap->bytes_per_rank_ = bytes;
  heap->local_ = static_cast<char*>(local);
  heap->bases_ = std::make_unique<void*[]>(heap->num_ranks_);
  for (int r = 0; r < heap->num_ranks_; ++r) {
    MPI_Aint size = 0;
    int disp = 0;
    EPSERVE_MPI_CHECK(MPI_Win_shared_query(heap->win_, r, &size, &disp, &heap->bases_[r]));
    if (static_cast<size_t>(size) != bytes) {
      return absl::InternalError(
          absl::StrCat("rank ", r, "'s heap segment has ", size, " bytes, expected ", bytes));
    }
  }
  std::memset(local, 0, bytes);
  // Everyone's segment is zeroed before anyone signals through it.
  EPSERVE_MPI_CHECK(MPI_Barrier(comm));
  return std::unique_ptr<SymmetricHeap>(std::move(heap));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SymmetricHeap>> CreateShmHeap(MPI_Comm comm, size_t bytes) {
  return ShmHeap::Create(comm, bytes);
}

}  // namespace epserve::shmem::detail
