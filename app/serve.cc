#include "app/serve.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "app/stop.h"
#include "common/log.h"
#include "worker/worker.h"

namespace epserve::app {
namespace {

// This process's resident set size (VmRSS), or -1 where /proc does not tell.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// A worker's account of itself once its weights are loaded and its kernels warm.
void LogWorker(int me, const worker::Worker& w, const worker::WorkerOptions& options) {
  common::LogInfo(absl::StrCat("worker ", me, " on ", w.device().Describe(), ": ", w.weight_bytes(),
                               " weight bytes (expert FFN on ", w.ffn_kernels(), "), resident ",
                               ResidentBytes(), " bytes"));
  common::LogInfo(absl::StrCat(
      "worker ", me, " FFN blocking: ", w.ffn_blocking(), "; combine on ", w.host_threads(),
      " host thread(s)", options.host_threads > 0 ? " (--worker-host-threads)" : "",
      w.stages_transfers() ? "; large host<->device copies through pinned staging on them" : "",
      options.local_pass ? "; a batch with one live worker runs on its device alone" : "",
      "; rows between workers go ", w.exchange_path(),
      w.uploads_ahead() ? "; the next batch's rows uploaded while a batch computes" : "",
      "; kernels warmed up in ", absl::FormatDuration(absl::Seconds(w.warmup_seconds()))));
}

}  // namespace

int ServeFrontEnd(const Flags& flags, const Job& job, worker::Coordinator& coordinator,
                  std::unique_ptr<server::FrontEnd>& front_end) {
  // A worker's death the survivors cannot serve through ends the job, as mpirun does
  // without --enable-recovery, so that the supervisor starts a new one.
  coordinator.set_on_fatal_death([](const std::string& why) {
    common::LogInfo(absl::StrCat("error: a worker died and the service cannot go on without it (",
                                 why, "); ending the job"));
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  });
  absl::Status s = coordinator.WaitForWorkers(absl::Now() + flags.startup_timeout);
  if (!s.ok()) {
    common::LogInfo(absl::StrCat("error: ", s.ToString()));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  server::FrontEndOptions options = flags.fe;
  options.ranks_on_host = job.ranks_on_host;
  absl::StatusOr<std::unique_ptr<server::FrontEnd>> fe = server::FrontEnd::Start(
      options, job.config(), flags.worker.device.device, coordinator,
      static_cast<int64_t>(job.heap_bytes), job.open_model, static_cast<uint64_t>(flags.seed));
  if (!fe.ok()) {
    common::LogInfo(absl::StrCat("error: ", fe.status().ToString()));
    coordinator.Stop(absl::Now() + absl::Seconds(5)).IgnoreError();
    return 1;
  }
  common::LogInfo(absl::StrCat("serving model '", flags.fe.requests.model_name, "' on ",
                               (*fe)->grpc_address(), ", metrics on http://",
                               (*fe)->metrics_address(), "/metrics"));
  while (!Stop().requested.load()) absl::SleepFor(absl::Milliseconds(20));
  common::LogInfo("stopping: answering requests in flight");
  const absl::Time stop_start = absl::Now();
  s = (*fe)->Shutdown();
  if (!s.ok()) common::LogInfo(absl::StrCat("workers did not stop cleanly: ", s.ToString()));
  common::LogInfo(
      absl::StrCat("stopped serving in ", absl::FormatDuration(absl::Now() - stop_start)));
  front_end = *std::move(fe);
  if (coordinator.lost_workers() > 0) Stop().peer_died.store(true);
  return 0;
}

int ServeWorker(int rank, const Flags& flags, Job& job, shmem::SymmetricHeap& heap,
                const worker::HeapRegions& regions) {
  // The flags' options, completed with what is this worker's own.
  worker::WorkerOptions options = flags.worker;
  options.device.local_rank = job.host_workers.index;
  options.workers_on_host = job.host_workers.count;
  options.open_model = job.open_model;
  options.placements = std::move(job.placements);
  absl::StatusOr<std::unique_ptr<worker::Worker>> w =
      worker::Worker::Create(heap, regions, *job.source, options);
  if (!w.ok()) {
    common::LogInfo(absl::StrCat("error: ", w.status().ToString()));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  const int me = worker::WorkerOfRank(rank);
  LogWorker(me, **w, options);
  absl::Status s = (*w)->Serve(Stop().requested);
  if ((*w)->uploads_ahead()) {
    common::LogInfo(absl::StrCat("worker ", me, ": the rows of ", (*w)->batches_uploaded_ahead(),
                                 " of ", (*w)->batches_served(),
                                 " batches were on the device before their batch began"));
  }
  if ((*w)->peers_lost()) Stop().peer_died.store(true);
  if (!s.ok()) {
    common::LogInfo(s.ToString());
    return 1;
  }
  return 0;
}

}  // namespace epserve::app
