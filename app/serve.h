// The two roles of an epserve rank, once the job is planned and the heap made: rank 0 serves
// the front-end over the coordinator, every other rank is an expert worker. Each returns the
// rank's exit code once Stop().requested (or rank 0's kStop, for a worker) ended its serving.
#pragma once

#include <memory>

#include "app/flags.h"
#include "app/job.h"
#include "server/front_end.h"
#include "shmem/heap.h"
#include "worker/coordinator.h"
#include "worker/heap_regions.h"

namespace epserve::app {

// Rank 0: waits for the workers, serves until a stop signal, then drains. The front-end
// comes back through `front_end`: its teardown is slow and must not hold up the heap's.
int ServeFrontEnd(const Flags& flags, const Job& job, worker::Coordinator& coordinator,
                  std::unique_ptr<server::FrontEnd>& front_end);

// A worker rank: loads its experts onto its device and serves batches until rank 0 stops it.
// Takes the job's placements.
int ServeWorker(int rank, const Flags& flags, Job& job, shmem::SymmetricHeap& heap,
                const worker::HeapRegions& regions);

}  // namespace epserve::app
