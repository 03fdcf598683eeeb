// epserve's command line: every flag bound straight to its home, the options struct of the
// component that reads it (FrontEndOptions' groups, the kernels' RuntimeOptions, the
// exchange's), or to a field of Flags for the job's own. Part of the epserve executable.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "common/flags.h"
#include "kernels/runtime.h"
#include "server/front_end.h"
#include "worker/exchange_config.h"

namespace epserve::server {

struct Flags {
  // The job's.
  std::string model = "synthetic:qwen1.5-moe-a2.7b";
  int64_t seed = 0;
  std::string layers = "all";
  std::string memory_limit;  // parsed by ParseMemoryLimit
  absl::Duration startup_timeout = absl::Minutes(10);
  // Rank 0's front-end (checked by FrontEndOptions::Validate, on every rank).
  FrontEndOptions fe;
  // Each worker's device and FFN kernels (local_rank is set per worker).
  kernels::RuntimeOptions runtime;
  std::string weight_dtype = "fp32";  // parsed with kernels::kKernelTypes
  // The exchange's (checked by ExchangePlan::Make).
  worker::ExchangeOptions exchange;
  // Expert placement (server/eplb_profile.h): redundant copies per layer, and the saved load
  // profile they follow (empty: uniform loads).
  int redundant_experts = 0;
  int worker_host_threads = 0;           // --worker-host-threads (WorkerOptions::host_threads)
  bool worker_local_pass = true;         // --worker-local-pass (WorkerOptions::local_pass)
  std::string device_exchange = "auto";  // --device-exchange (WorkerOptions::device_exchange)
  std::string upload_ahead = "auto";     // --upload-ahead (WorkerOptions::upload_ahead)
  bool pinned_transfers = true;  // --pinned-transfers (RuntimeOptions::staging kAuto / kOff)
  std::string eplb_profile;
};

// Registers every flag of epserve, bound to its field of `flags`, whose values are the
// defaults; --help lists them in this order.
void RegisterFlags(common::FlagSet& fs, Flags& flags);

}  // namespace epserve::server
