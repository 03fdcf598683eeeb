// main() for gtest binaries run under mpirun: every rank runs every test; failures are
// summed over ranks with an allreduce so all ranks agree and exit with the same code.
#include <mpi.h>

#include <cstdio>

#include "gtest/gtest.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    // Only rank 0 prints the usual report; other ranks print their failures.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int failed = 0;
  MPI_Allreduce(&local_failed, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0 && failed > 0) std::fprintf(stderr, "%d rank(s) failed\n", failed);
  MPI_Finalize();
  return failed == 0 ? 0 : 1;
}
