// epserve: one MPI program. Rank 0 is the gRPC front-end; ranks 1..W are expert workers.
//   mpirun -np 3 epserve --model=synthetic:qwen1.5-moe-a2.7b
// The composition, in construction order: flags (app/flags.h), MPI, the job's plan
// (app/job.h: model, exchange plan, admission, placements), the symmetric heap and its
// regions, then the rank's role (app/serve.h: the coordinator and front-end on rank 0, a
// worker elsewhere); teardown runs the other way (see Run).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "app/flags.h"
#include "app/job.h"
#include "app/serve.h"
#include "app/stop.h"
#include "common/flags.h"
#include "common/log.h"
#include "server/front_end.h"
#include "server/service.h"
#include "shmem/heap.h"
#include "worker/coordinator.h"
#include "worker/heap_regions.h"

namespace {

using epserve::app::Flags;
using epserve::app::Stop;

// Every rank reaches the same verdict on the flags, so all leave together.
int Fail(const absl::Status& s) {
  epserve::common::LogInfo(absl::StrCat("error: ", s.ToString()));
  return 1;
}

// How a rank leaves once its role returned: without MPI's collective teardown where a rank
// died earlier (it would wait for the dead one); else the heap's collective free, under a
// watchdog, before rank 0's front-end (whose teardown, the metrics server's threads, is slow).
int Leave(int code, std::unique_ptr<epserve::shmem::SymmetricHeap>& heap,
          std::unique_ptr<epserve::server::FrontEnd>& front_end) {
  using epserve::common::LogInfo;
  if (Stop().peer_died.load()) {
    // Every answer is sent; the heap's free and MPI_Finalize would wait for the dead rank.
    LogInfo("a rank of this job died earlier: leaving without MPI's collective teardown");
    std::fflush(nullptr);
    std::_Exit(code);
  }
  // Leaving: if a peer is gone the collective free below could block; never hang.
  std::thread([] {
    absl::SleepFor(absl::Seconds(5));
    LogInfo("teardown did not finish within 5 s; exiting");
    std::_Exit(2);
  }).detach();
  heap.reset();
  LogInfo("left the heap");
  front_end.reset();
  return code;
}

// Every rank: the job's plan (all ranks reach the same verdict), the heap, then the
// front-end on rank 0 or a worker on the others, then the way out.
int Run(int rank, int num_ranks, const Flags& flags) {
  using namespace epserve;
  absl::StatusOr<app::Job> job = app::PlanJob(rank, num_ranks, flags);
  if (!job.ok()) return Fail(job.status());
  absl::StatusOr<std::unique_ptr<shmem::SymmetricHeap>> heap =
      shmem::SymmetricHeap::Create(MPI_COMM_WORLD, job->heap_bytes, job->plan.heap_backend());
  if (!heap.ok()) return Fail(heap.status());
  absl::StatusOr<worker::HeapRegions> regions = worker::HeapRegions::Allocate(**heap, job->plan);
  if (!regions.ok()) return Fail(regions.status());
  if (rank == 0) app::LogJob(*job, **heap);

  // Teardown order: a worker is gone (ServeWorker returned) before the heap; rank 0's
  // front-end after it (Leave); the coordinator, which holds nothing of its own, last.
  int code = 0;
  std::optional<worker::Coordinator> coordinator;
  std::unique_ptr<server::FrontEnd> front_end;
  if (rank == 0) {
    coordinator.emplace(**heap, *regions, job->placements);
    code = app::ServeFrontEnd(flags, *job, *coordinator, front_end);
  } else {
    code = app::ServeWorker(rank, flags, *job, **heap, *regions);
  }
  return Leave(code, *heap, front_end);
}

// Starts MPI: the thread level it `provided`, this process's rank and the job's ranks.
// Rank 0's batcher thread makes the MPI calls of the rma heap, and a weight swap's thread
// only while it holds the lock the batches run under (FrontEnd's exec_mu_), as does the
// main thread's final stop; the workers' loader threads make none: calls never overlap,
// so SERIALIZED is enough.
absl::Status StartMpi(int& argc, char**& argv, int& provided, int& rank, int& num_ranks) {
  EPSERVE_MPI_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided));
  EPSERVE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  EPSERVE_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &num_ranks));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // Buffers of 4 MiB and more (large requests and answers, weights being loaded) come from
  // mmap and go back to the system when freed; smaller ones stay in the arenas for the next
  // requests (server::ConfigureAllocator). --keep-request-buffers changes this on rank 0.
  epserve::server::ConfigureAllocator(/*keep_request_buffers=*/false);
  Flags flags;
  epserve::common::FlagSet fs(
      "epserve",
      "Serves MoE layers over gRPC (KServe v2). Launch as one MPI job:\n"
      "  mpirun -np 1+W epserve [flags]   (rank 0 front-end, W expert workers)");
  epserve::app::RegisterFlags(fs, flags);
  absl::Status parsed = fs.Parse(argc, argv);
  const char* env_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const bool first = env_rank == nullptr || absl::string_view(env_rank) == "0";
  if (fs.help_requested()) {
    if (first) std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  if (!parsed.ok()) {
    // Every rank says why, not rank 0 alone: the first rank to exit non-zero makes mpirun end
    // the others, and rank 0, slower to start (under a sanitizer, by seconds), could be ended
    // before it printed anything.
    std::fprintf(stderr, "epserve: %s\n", std::string(parsed.message()).c_str());
    return 2;
  }
  epserve::app::InstallStopHandlers();

  int provided = 0, rank = 0, num_ranks = 0;
  if (absl::Status s = StartMpi(argc, argv, provided, rank, num_ranks); !s.ok()) {
    std::fprintf(stderr, "epserve: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  epserve::common::SetLogRank(rank);
  if (rank == 0 && flags.fe.service.keep_request_buffers) {
    // Requests and answers up to 32 MiB (glibc's largest threshold; a 4096-token FP32 batch
    // of hidden 2048) come from the arenas, and free() gives no pages back on its own: the
    // next request reuses them, where an mmapped buffer faults every page in again
    // (thousands of faults per 16 MiB, several buffers per inline request). The service's
    // reaper gives them back once the load ends (InferenceService::Reap).
    epserve::server::ConfigureAllocator(/*keep_request_buffers=*/true);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    if (rank == 0) std::fprintf(stderr, "epserve: this MPI library lacks MPI_THREAD_SERIALIZED\n");
    EPSERVE_MPI_CHECK_LOG(MPI_Finalize());
    return 1;
  }
  const int code = Run(rank, num_ranks, flags);
  if (Stop().by_launcher.load()) {
    // mpirun forwarded a SIGTERM: it is ending the job and SIGKILLs every rank 1 s later.
    // Busy with that, it does not answer MPI_Finalize's handshake, which would block until
    // the SIGKILL. Every answer is sent and the heap is left: exit now.
    std::fflush(nullptr);
    std::_Exit(code);
  }
  EPSERVE_MPI_CHECK_LOG(MPI_Finalize());
  return code;
}
