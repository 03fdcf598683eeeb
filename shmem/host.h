// Which ranks of a communicator share this rank's host, written once: the heap's choice of
// backend, the memory check of the ranks on a host and a worker's index among its host's
// workers (its GPU with --device=gpu) all read it.
#pragma once

#include <mpi.h>

#include <vector>

#include "absl/status/statusor.h"

namespace epserve::shmem {

// The ranks of `comm` on this rank's host (MPI_COMM_TYPE_SHARED: those that can share
// memory), as ranks of `comm`, ascending; this rank is among them. Collective over `comm`:
// every rank calls it, and ranks on one host get the same list.
absl::StatusOr<std::vector<int>> RanksOnThisHost(MPI_Comm comm);

}  // namespace epserve::shmem
