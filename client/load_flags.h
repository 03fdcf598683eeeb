// epserve-load's command line: the flags, their --help text, and the settings they give.
// Private to the epserve-load tool (client/epserve_load_main.cc). Functions here print
// nothing; each error names the flag.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/expert_skew.h"
#include "client/load_generator.h"
#include "client/server_queries.h"
#include "common/flags.h"

namespace epserve::client {

// The text --help prints above the flags.
extern const char kLoadUsageSummary[];

// The flags' values, as given (defaults as --help shows them).
struct LoadFlags {
  std::string target = "127.0.0.1:8001";
  std::string model = "moe";
  std::string tokens = "32";
  int64_t hidden = 0;
  std::string layer;
  std::string concurrency;
  std::string rate;
  std::string arrival = "constant";
  std::string duration;
  int64_t requests = 0;
  absl::Duration warmup = absl::Seconds(1);
  absl::Duration timeout = absl::Seconds(10);
  absl::Duration connect_timeout = absl::Seconds(10);
  int64_t seed = 1;
  int connections = 1;
  int threads = 0;
  int64_t max_outstanding = 4096;
  std::string dtype = "FP32";
  bool stream = false;
  int streams = 0;
  bool shared_memory = false;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_server_name;
  bool tls = false;
  std::string token;
  std::string token_file;
  bool server_stats = true;
  bool verify = false;
  std::string verify_model;
  int64_t verify_seed = 0;
  double verify_tolerance = 0;
  std::string expert_skew;
  std::string skew_model;
  int64_t skew_seed = 1;
  bool json = false;
  bool csv = false;
  std::string plot;
  std::string progress = "auto";
  bool fail_on_error = false;
};

// Registers every flag of `f` on `fs`, in the order --help lists them.
void RegisterFlags(common::FlagSet& fs, LoadFlags& f);

// Flag names may use '_' (absl's spelling, which earlier versions took): "--a_b[=v]" and
// "--no_a_b" become "--a-b[=v]" and "--no-a-b". Values are left alone.
std::vector<std::string> NormalizeFlagNames(int argc, char** argv);

// The steps: one per --rate value (open loop), else one per --concurrency value (closed
// loop, 1 when neither is given). INVALID_ARGUMENT naming the bad value.
absl::StatusOr<std::vector<StepSpec>> StepsFromFlags(const LoadFlags& f);

// Flags that exclude each other or go together, and the values of --progress.
absl::Status CheckFlagCombinations(const LoadFlags& f);

// The settings of every step, from the flags (the token, the verifier, the rows' shape and
// the shared memory come later). INVALID_ARGUMENT naming the flag.
absl::StatusOr<LoadOptions> LoadOptionsFromFlags(const LoadFlags& f);

// The target, TLS settings and PEM files of the flags; NOT_FOUND naming an unreadable file.
absl::StatusOr<ChannelOptions> ChannelOptionsFromFlags(const LoadFlags& f);

// --token, or the contents of --token-file without surrounding whitespace; NOT_FOUND when
// the file cannot be read.
absl::StatusOr<std::string> TokenFromFlags(const LoadFlags& f);

// --expert-skew, and the served model it needs named. INVALID_ARGUMENT otherwise.
absl::StatusOr<ExpertSkew> ExpertSkewFromFlags(const LoadFlags& f);

}  // namespace epserve::client
