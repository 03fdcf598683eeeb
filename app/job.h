// What every rank of epserve sets up from the flags before it serves: the model, the
// exchange's plan, the host's admission check, the placements and the rank's place on its
// host. Each step reaches the same verdict on every rank, so that all leave together.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "app/flags.h"
#include "model/weights.h"
#include "server/front_end.h"
#include "shmem/heap.h"
#include "worker/exchange_config.h"
#include "worker/placement.h"

namespace epserve::app {

// Opens a model as --model and --layers name it: at start, and for weight swaps
// (RepositoryModelLoad), on rank 0 to check it and on every worker to load it.
using ModelOpener = server::FrontEnd::ModelOpener;
ModelOpener MakeModelOpener(const std::string& layers);

struct Job {
  ModelOpener open_model;
  std::unique_ptr<model::WeightSource> source;  // the model at start (a worker's weights)
  worker::ExchangePlan plan;
  size_t heap_bytes = 0;                            // one rank's segment
  std::vector<worker::ExpertPlacement> placements;  // one per served layer
  worker::HostWorkers host_workers;                 // this rank's place on its host
  int ranks_on_host = 1;                            // the job's ranks on it, this one included

  const model::ModelConfig& config() const { return source->config(); }
};

// Every rank: opens the model, checks the flags (Flags::Validate) and plans the exchange for
// the model, checks that the ranks of each host fit --memory-limit (collective: every rank
// learns of any host's refusal), places the experts and finds the workers of this host
// (collective). `rank` of `num_ranks` in MPI_COMM_WORLD.
absl::StatusOr<Job> PlanJob(int rank, int num_ranks, const Flags& flags);

// Rank 0's account of the job at start: the heap, the model, the placements.
void LogJob(const Job& job, const shmem::SymmetricHeap& heap);

}  // namespace epserve::app
