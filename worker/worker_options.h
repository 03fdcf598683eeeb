// What a worker rank is told at start: its device and kernels (kernels::RuntimeOptions), its
// weights' element type, its host threads and which of its paths run. Plain data without
// OpenCL (the epserve executable's flags bind to it); worker/worker.h reads it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/element_type.h"
#include "kernels/runtime_options.h"
#include "model/weights.h"
#include "worker/placement.h"

namespace epserve::worker {

// --device-exchange: auto (cuda where every worker is a GPU that imports CUDA memory and the
// heap is shm, else off), off, host (shared host memory: CPU devices), cuda.
enum class DeviceExchangeMode { kAuto, kOff, kHost, kCuda };
absl::StatusOr<DeviceExchangeMode> ParseDeviceExchangeMode(absl::string_view name);
const char* DeviceExchangeModeName(DeviceExchangeMode mode);

// A setting that is on, off, or chosen by the worker from its device (auto).
enum class AutoSwitch { kAuto, kOn, kOff };

struct WorkerOptions {
  kernels::RuntimeOptions device;
  // Element type of the expert weights (routed and shared) on the device; the router stays FP32.
  common::ElementType weight_dtype = common::ElementType::kFp32;
  // A stop request (e.g. SIGTERM) ends the loop once no batch has come for this long,
  // even if rank 0 never sends kStop (rank 0 gone).
  absl::Duration orphan_grace = absl::Seconds(3);
  // The longest sleep of an idle worker between two looks for the next batch (what a batch
  // that finds it asleep waits at most before it starts); 0: 20 us where the host has at
  // least 4 hardware threads for each rank on it (its workers and rank 0), else 200 us, which
  // leaves the cores to the ranks that compute (--worker-idle-poll).
  absl::Duration idle_poll = absl::ZeroDuration();
  // Workers on this host (this one included): a weight swap stages a second copy of every
  // one's weights at once, so each checks that all those copies fit the host's memory.
  int workers_on_host = 1;
  // Host threads of this worker's combine (the owner's sum of its tokens' returned rows,
  // Exchange::set_reduce_threads); 0: the host's hardware threads shared among its workers
  // and rank 0, 1 to 8 (--worker-host-threads).
  int host_threads = 0;
  // A batch of which this worker is the only live worker (a one-worker job, or the last
  // survivor) runs on its device alone: rows go up once and the layer's output comes down
  // once, the FFN reads the rows where the router read them and the owner's sum runs on the
  // device, with the bits the exchange gives (RunLocal). false: through the heap exchange,
  // as with several workers (--worker-local-pass; for comparison).
  bool local_pass = true;
  // Whether the exchange moves rows between the workers' devices (worker/device_exchange.h):
  // kAuto does where every worker is a GPU that imports CUDA memory (and the heap is shm);
  // kHost shares host memory among CPU devices; kCuda requires the GPU path. A worker whose
  // device cannot is an error with kHost/kCuda, the heap exchange with kAuto.
  DeviceExchangeMode device_exchange = DeviceExchangeMode::kAuto;
  // Every wait of the start-up rendezvous of the device exchange ends by then.
  absl::Duration rendezvous_timeout = absl::Seconds(60);
  // Upload the next batch's rows (announced by rank 0, RowsAhead) through a second queue while
  // the device computes the current batch's experts, so that the next batch starts with its
  // rows on the device. kAuto: on devices with memory of their own (on a CPU device the upload
  // is a copy that competes with the kernels for the same cores).
  AutoSwitch upload_ahead = AutoSwitch::kAuto;
  // Whether this worker reads and writes the rows of requests in clients' system shared memory
  // itself (worker/host_rows.h), so that rank 0 copies none of them; only where the heap is shm
  // (every rank on one host), and rank 0 uses it only where every worker does. kAuto: on
  // devices with memory of their own (on a CPU device the kernels read rank 0's copy in place,
  // so the worker's reads would only move rank 0's copy onto the worker).
  AutoSwitch reads_shm = AutoSwitch::kAuto;
  // Which worker holds which experts, one placement per served layer (the same on every rank;
  // worker/placement.h); empty: the contiguous placement for every layer. A kStage may bring
  // new ones (a rebalance), served from its kSwitch on.
  std::vector<ExpertPlacement> placements;
  // Opens the model a weight swap names (as --model names one, with the served layers
  // selected as at start); without it the worker refuses swaps (UNIMPLEMENTED).
  std::function<absl::StatusOr<std::unique_ptr<model::WeightSource>>(const std::string& model,
                                                                     uint64_t seed)>
      open_model;

  // INVALID_ARGUMENT naming the flag and its bound where a setting is out of range. Every
  // rank checks the same flags before the exchange is planned, so all reach the same verdict.
  absl::Status Validate() const;
};

// The names of an AutoSwitch flag's settings: auto, on, off (an error names --`flag`).
absl::StatusOr<AutoSwitch> ParseAutoSwitch(absl::string_view flag, absl::string_view name);
const char* AutoSwitchName(AutoSwitch mode);

}  // namespace epserve::worker
