// How a rank of epserve learns that it must stop, and how it must then leave. Set from the
// signal handlers (async-signal-safe: lock-free atomics only) and from the serving code; read
// by main. One per process.
#pragma once

#include <atomic>

namespace epserve::app {

struct StopState {
  // SIGTERM or SIGINT came: serving ends.
  std::atomic<bool> requested{false};
  // The stop signal came from this rank's parent: mpirun (or its orted), ending the job.
  std::atomic<bool> by_launcher{false};
  // A rank of the job died and this one served on without it: MPI's collective teardown (the
  // heap's free, MPI_Finalize) would wait for the dead rank, so the job's ranks leave without.
  std::atomic<bool> peer_died{false};
};

// The process's.
StopState& Stop();

// SIGTERM and SIGINT set Stop().requested (and by_launcher when the parent sent them).
void InstallStopHandlers();

}  // namespace epserve::app
