// The two heap backends, created by SymmetricHeap::Create. Private to shmem/.
#pragma once

#include <mpi.h>

#include <memory>

#include "absl/status/statusor.h"
#include "shmem/heap.h"

namespace epserve::shmem::detail {

// Both take ownership of `comm` (a duplicate made by Create) and free it when they fail.
absl::StatusOr<std::unique_ptr<SymmetricHeap>> CreateShmHeap(MPI_Comm comm, size_t bytes_per_rank);
absl::StatusOr<std::unique_ptr<SymmetricHeap>> CreateRmaHeap(MPI_Comm comm, size_t bytes_per_rank);

}  // namespace epserve::shmem::detail
