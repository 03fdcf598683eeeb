// Starts `mpirun -np N epserve ...` for a test, waits for its ready file, and stops it.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc_service.grpc.pb.h"

namespace epserve::testing {

struct ServerExit {
  int exit_code = -1;      // of mpirun; -1 when killed
  absl::Duration elapsed;  // from the stop signal to mpirun's exit
};

class ServerProcess {
 public:
  // Launches ranks processes with `args` after the defaults (tiny model, port 0 on
  // 127.0.0.1 for gRPC and metrics, a ready file in a fresh temporary folder).
  // `mpirun_args` go to mpirun before the program (e.g. --enable-recovery).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      int ranks, std::vector<std::string> args, absl::Duration ready_timeout = absl::Seconds(120),
      std::vector<std::string> mpirun_args = {});
  // Runs the job to completion (for startup errors): exit code and everything it printed.
  static absl::StatusOr<std::pair<int, std::string>> RunToExit(int ranks,
                                                               std::vector<std::string> args,
                                                               absl::Duration timeout);
  ~ServerProcess();  // SIGKILL if still running

  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  std::unique_ptr<inference::GRPCInferenceService::Stub> NewStub() const;
  std::string Log() const;  // everything the job printed so far
  // The log once `done(log)` holds, or as it is after `wait`: what the ranks print reaches the
  // log through mpirun's forwarding, which may lag the ready file and the answers.
  std::string WaitForLog(const std::function<bool(const std::string&)>& done,
                         absl::Duration wait = absl::Seconds(30)) const;
  // The process of MPI rank `rank` (from its OMPI_COMM_WORLD_RANK), waited for up to `wait`
  // (a rank may still be starting when a test looks, above all on a loaded machine), or -1.
  pid_t RankPid(int rank, absl::Duration wait = absl::Seconds(30)) const;
  // Whether mpirun has exited (reaps it); its exit code then in *code (-1: killed).
  bool Exited(int* code = nullptr);

  // Sends `signal` to mpirun and waits up to `timeout` for it to exit. On timeout the error
  // lists every process of the job still there, with its state.
  absl::StatusOr<ServerExit> Stop(int signal, absl::Duration timeout);
  // The same, but `signal` goes to every rank instead of mpirun (as a process manager that
  // signals each process of a job does).
  absl::StatusOr<ServerExit> StopRanks(int signal, absl::Duration timeout);

 private:
  absl::StatusOr<ServerExit> WaitForExit(absl::Time start, absl::Duration timeout);

  pid_t pid_ = -1;
  std::string dir_;
  std::string grpc_address_;
  std::string metrics_address_;
};

}  // namespace epserve::testing
