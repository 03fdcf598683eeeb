// epserve's command line: every flag bound straight to its home, the options struct of the
// component that reads it (FrontEndOptions' groups, the workers' WorkerOptions with the
// kernels' RuntimeOptions, the exchange's ExchangeOptions), or to a field of Flags for the
// job's own, typed (enums, element types, byte counts) by the flag library as it parses.
// Part of the epserve executable.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/flags.h"
#include "server/front_end.h"
#include "worker/exchange_config.h"
#include "worker/worker_options.h"

namespace epserve::app {

struct Flags {
  // The job's.
  std::string model = "synthetic:qwen1.5-moe-a2.7b";
  int64_t seed = 0;
  std::string layers = "all";
  int64_t memory_limit_bytes = 0;  // --memory-limit; 0: the machine's (model::CheckHostMemory)
  absl::Duration startup_timeout = absl::Minutes(10);
  // Rank 0's front-end (FrontEndOptions::Validate).
  server::FrontEndOptions fe;
  // Each worker's device, kernels, weight dtype and paths (WorkerOptions::Validate); what is
  // the worker's own (its GPU among its host's, its placements) is set when it starts.
  worker::WorkerOptions worker;
  // The exchange's (checked with the model's shape by ExchangePlan::Make).
  worker::ExchangeOptions exchange;
  // Expert placement (server/eplb_profile.h): redundant copies per layer, and the saved load
  // profile they follow (empty: uniform loads).
  int redundant_experts = 0;
  std::string eplb_profile;

  // The checks of the flags alone, each group's own, once: every rank runs it before the
  // exchange is planned, so all reach the same verdict.
  absl::Status Validate() const;
};

// Registers every flag of epserve, bound to its field of `flags`, whose values are the
// defaults; --help lists them in this order.
void RegisterFlags(common::FlagSet& fs, Flags& flags);

}  // namespace epserve::app
