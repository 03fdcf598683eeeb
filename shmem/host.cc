#include "shmem/host.h"

#include "shmem/heap.h"

namespace epserve::shmem {

absl::StatusOr<std::vector<int>> RanksOnThisHost(MPI_Comm comm) {
  int rank = 0;
  EPSERVE_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  // Keyed by the rank in `comm`, so the node communicator keeps its order.
  MPI_Comm node = MPI_COMM_NULL;
  EPSERVE_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  int node_size = 0;
  EPSERVE_MPI_CHECK(MPI_Comm_size(node, &node_size));
  std::vector<int> ranks(node_size);
  EPSERVE_MPI_CHECK(MPI_Allgather(&rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, node));
  EPSERVE_MPI_CHECK(MPI_Comm_free(&node));
  return ranks;
}

}  // namespace epserve::shmem
