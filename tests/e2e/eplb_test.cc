// Expert placement end to end: the service with --redundant-experts (uniform, and placed by a
// saved --eplb-profile) answers bit-identically to the unreplicated service at 2, 3 and 4
// workers, every answer right against the reference; a one-worker job's local pass and rows
// moved device to device (--device-exchange) answer as the heap exchange does; the server's
// GET /eplb/profile is a
// profile --eplb-profile reads; the placement's metrics are exported.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "model/load_profile.h"
#include "tests/common/http_get.h"
#include "tests/e2e/reference.h"
#include "tests/e2e/server_process.h"
#include "tests/e2e/verifying_clients.h"

namespace epserve::testing {
namespace {

constexpr int kExperts = 8;  // synthetic:tiny

// Answers of `server` to `requests` (each [tokens, H]) on `layer`, in order; empty on error.
std::vector<std::vector<float>> Answers(ServerProcess& server,
                                        const std::vector<std::vector<float>>& requests,
                                        int layer) {
  auto stub = server.NewStub();
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t tokens = static_cast<int64_t>(requests[i].size()) / kHidden;
    inference::ModelInferRequest req = Request(requests[i], tokens, absl::StrCat("r", i));
    auto* p = req.mutable_parameters();
    (*p)["layer"].set_int64_param(layer);
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    if (!s.ok() || resp.raw_output_contents_size() != 1) return {};
    std::vector<float>& y = out.emplace_back(tokens * kHidden);
    EXPECT_EQ(resp.raw_output_contents(0).size(), y.size() * sizeof(float));
    std::memcpy(y.data(), resp.raw_output_contents(0).data(),
                std::min(resp.raw_output_contents(0).size(), y.size() * sizeof(float)));
  }
  return out;
}

// The payload dtypes and the shared expert's place of one case: the flags that set them, and
// whether every payload is FP32 (then answers are held to 1e-4, else 2e-2).
struct Payloads {
  const char* weights;
  const char* dispatch;
  const char* combine;
  const char* shared;
  std::vector<std::string> Flags() const {
    return {absl::StrCat("--weight-dtype=", weights), absl::StrCat("--dispatch-dtype=", dispatch),
            absl::StrCat("--combine-dtype=", combine), absl::StrCat("--shared-expert=", shared)};
  }
  std::string Name() const {
    return absl::StrCat("weights ", weights, ", dispatch ", dispatch, ", combine ", combine,
                        ", shared expert ", shared);
  }
  bool AllFp32() const {
    return std::string(weights) == "fp32" && std::string(dispatch) == "fp32" &&
           std::string(combine) == "fp32";
  }
};

// Two services' answers to `requests` on layer `layer_pos`: the same bits, and the first's
// within 1e-4 (`exact`: FP32 throughout) or 2e-2 of the reference.
void ExpectSameBitsAndRight(Reference& ref, const std::vector<std::vector<float>>& requests,
                            const std::vector<std::vector<float>> (&answers)[2], int layer_pos,
                            bool exact) {
  ASSERT_EQ(answers[0].size(), requests.size());
  ASSERT_EQ(answers[1].size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(std::memcmp(answers[0][i].data(), answers[1][i].data(),
                          answers[0][i].size() * sizeof(float)),
              0)
        << "request " << i;
    EXPECT_LE(ref.RelError(requests[i], answers[0][i].data(),
                           static_cast<int64_t>(requests[i].size()) / kHidden, layer_pos),
              exact ? 1e-4 : 2e-2)
        << "request " << i;
  }
}

class Placement : public ::testing::TestWithParam<int> {};

TEST_P(Placement, ReplicatedServiceAnswersBitIdenticallyToTheUnreplicatedOne) {
  const int workers = GetParam();
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> requests;
  for (int64_t tokens : {1, 5, 16, 37, 3}) requests.push_back(RandomRows(tokens, rng));
  Reference ref;
  const std::vector<std::string> common_args = {"--max-batch-tokens=32",
                                                "--max-queue-delay-us=500"};

  // The unreplicated service: the baseline, and the profile of its load.
  std::vector<std::vector<float>> base[2];
  std::string profile_json;
  {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start(1 + workers, common_args);
    ASSERT_TRUE(server.ok()) << server.status();
    for (int layer : {0, 1}) base[layer] = Answers(**server, requests, layer);
    profile_json = HttpGet((*server)->metrics_address(), "/eplb/profile");
    (*server)->Stop(SIGTERM, absl::Seconds(15)).IgnoreError();
  }
  ASSERT_EQ(base[0].size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_LE(ref.RelError(requests[i], base[0][i].data(),
                           static_cast<int64_t>(requests[i].size()) / kHidden),
              1e-4);
  }
  absl::StatusOr<model::ExpertLoadProfile> profile = model::ParseExpertLoadProfile(profile_json);
  ASSERT_TRUE(profile.ok()) << profile.status() << "\n" << profile_json;
  EXPECT_EQ(profile->num_experts, kExperts);
  ASSERT_EQ(profile->layers.size(), 2u);
  double pairs = 0;
  for (double v : profile->layers[0]) pairs += v;
  EXPECT_EQ(pairs, (1 + 5 + 16 + 37 + 3) * 2);  // every token of layer 0, top-2
  const std::string profile_path = ::testing::TempDir() + "/eplb_profile.json";
  std::ofstream(profile_path) << profile_json;

  // Replicated: uniform (redundant copies of the lowest experts), then by the profile.
  const int redundant = workers + 1;
  for (bool use_profile : {false, true}) {
    std::vector<std::string> args = common_args;
    args.push_back(absl::StrCat("--redundant-experts=", redundant));
    if (use_profile) args.push_back("--eplb-profile=" + profile_path);
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(1 + workers, args);
    ASSERT_TRUE(server.ok()) << server.status();
    for (int layer : {0, 1}) {
      const std::vector<std::vector<float>> got = Answers(**server, requests, layer);
      ASSERT_EQ(got.size(), base[layer].size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(std::memcmp(got[i].data(), base[layer][i].data(), got[i].size() * 4), 0)
            << workers << " workers, layer " << layer << ", request " << i << ", profile "
            << use_profile << ", seed " << seed;
      }
    }
    const std::string metrics = HttpGet((*server)->metrics_address(), "/metrics");
    // Every copy counted: the experts' replicas sum to E + redundant per layer.
    double copies = 0;
    size_t at = 0;
    const std::string series = "epserve_expert_replicas{";
    while ((at = metrics.find(series, at)) != std::string::npos) {
      const size_t line_end = metrics.find('\n', at);
      const std::string line = metrics.substr(at, line_end - at);
      if (line.find("layer=\"0\"") != std::string::npos) {
        copies += std::stod(line.substr(line.rfind(' ') + 1));
      }
      at = line_end;
    }
    EXPECT_EQ(copies, kExperts + redundant) << metrics;
    EXPECT_NE(metrics.find("epserve_worker_balancedness{layer=\"0\"}"), std::string::npos);
    EXPECT_NE(metrics.find(absl::StrCat("epserve_worker_pairs_total{layer=\"0\",worker=\"",
                                        workers - 1, "\"}")),
              std::string::npos)
        << metrics;
    if (HasFailure()) ADD_FAILURE() << (*server)->Log();
    (*server)->Stop(SIGTERM, absl::Seconds(15)).IgnoreError();
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, Placement, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return absl::StrCat(p.param, "_workers");
                         });

// A one-worker job runs each batch on its device alone (the local pass: no exchange, the
// owner's sum on the device); its answers have the bits of the same job through the heap
// exchange (--no-worker-local-pass), for every payload dtype the local pass reproduces and
// both places of the shared expert, and are right against the reference.
TEST(LocalPass, OneWorkerOnItsDeviceAnswersAsTheExchangeDoes) {
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> requests;
  for (int64_t tokens : {1, 6, 32, 19}) requests.push_back(RandomRows(tokens, rng));
  Reference ref;
  for (const Payloads& c :
       {Payloads{"fp32", "fp32", "fp32", "owner"}, Payloads{"fp32", "bf16", "bf16", "owner"},
        Payloads{"bf16", "bf16", "fp32", "split"}, Payloads{"fp32", "fp32", "bf16", "split"}}) {
    SCOPED_TRACE(absl::StrCat(c.Name(), ", seed ", seed));
    std::vector<std::vector<float>> answers[2];
    for (bool local : {true, false}) {
      std::vector<std::string> args = {"--max-batch-tokens=32", "--max-queue-delay-us=500",
                                       local ? "--worker-local-pass" : "--no-worker-local-pass"};
      for (std::string& f : c.Flags()) args.push_back(std::move(f));
      absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(2, args);
      ASSERT_TRUE(server.ok()) << server.status();
      answers[local ? 0 : 1] = Answers(**server, requests, 0);
      if (HasFailure()) ADD_FAILURE() << (*server)->Log();
      (*server)->Stop(SIGTERM, absl::Seconds(15)).IgnoreError();
    }
    ExpectSameBitsAndRight(ref, requests, answers, 0, c.AllFp32());
  }
}

// Rows moved between the workers' devices (--device-exchange=host: kernels write each row into
// its destination's receive rows and each owner gathers its tokens' output rows, through host
// memory the CPU devices share, by the protocol the GPU workers run over CUDA memory) give the
// bits of the heap exchange (--device-exchange=off), for 2 and 3 workers, every payload dtype
// the devices reproduce, both places of the shared expert and replicated experts; a batch too
// large for one pass takes the heap exchange in rounds and is right too.
TEST(DeviceExchange, RowsMovedDeviceToDeviceAnswerAsTheHeapExchangeDoes) {
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> requests;
  for (int64_t tokens : {1, 7, 32, 23}) requests.push_back(RandomRows(tokens, rng));
  Reference ref;
  struct Case {
    int workers;
    Payloads payloads;
    const char* extra;
  };
  for (const Case& c : {Case{2, {"fp32", "fp32", "fp32", "owner"}, ""},
                        Case{3, {"fp32", "fp32", "fp32", "split"}, ""},
                        Case{2, {"bf16", "bf16", "bf16", "split"}, ""},
                        Case{3, {"fp32", "bf16", "fp32", "owner"}, "--redundant-experts=4"},
                        Case{2, {"fp32", "fp32", "bf16", "split"}, "--redundant-experts=2"},
                        Case{2,
                             {"fp32", "fp32", "fp32", "split"},
                             "--max-recv-tokens-per-rank=24 --recv-overflow=split"}}) {
    SCOPED_TRACE(
        absl::StrCat(c.workers, " workers, ", c.payloads.Name(), " ", c.extra, ", seed ", seed));
    std::vector<std::vector<float>> answers[2];
    for (bool device : {true, false}) {
      std::vector<std::string> args = {"--max-batch-tokens=32", "--max-queue-delay-us=500",
                                       device ? "--device-exchange=host" : "--device-exchange=off"};
      for (std::string& f : c.payloads.Flags()) args.push_back(std::move(f));
      for (absl::string_view a : absl::StrSplit(c.extra, ' ', absl::SkipEmpty())) {
        args.emplace_back(a);
      }
      absl::StatusOr<std::unique_ptr<ServerProcess>> server =
          ServerProcess::Start(1 + c.workers, args);
      ASSERT_TRUE(server.ok()) << server.status();
      answers[device ? 0 : 1] = Answers(**server, requests, 1);
      const std::string said = device ? "rows between workers go device to device (host)"
                                      : "rows between workers go through the heap";
      const std::string log = (*server)->WaitForLog(
          [&](const std::string& l) { return l.find(said) != std::string::npos; });
      EXPECT_NE(log.find(said), std::string::npos) << log;
      if (HasFailure()) ADD_FAILURE() << log;
      (*server)->Stop(SIGTERM, absl::Seconds(15)).IgnoreError();
    }
    ExpectSameBitsAndRight(ref, requests, answers, 1, c.payloads.AllFp32());
  }
}

// Under 4 verifying clients (batches of several requests, two in flight), rows moved device to
// device, and batches whose rows were uploaded while the batch before computed
// (--upload-ahead=on), are every one right, through the exchange and a one-worker job's local
// pass; a device that cannot take part fails the job at start with the reason, on every worker
// (no worker waits for the others' rendezvous to time out).
TEST(DeviceExchange, UnderLoadEveryAnswerIsRightAndAnUnusableDeviceIsAClearError) {
  for (int ranks : {3, 2}) {
    SCOPED_TRACE(absl::StrCat(ranks - 1, " workers"));
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start(ranks, {"--max-batch-tokens=32", "--max-queue-delay-us=500",
                                     "--device-exchange=host", "--upload-ahead=on"});
    ASSERT_TRUE(server.ok()) << server.status();
    {
      VerifyingClients clients(**server);
      absl::SleepFor(absl::Seconds(4));
      clients.Stop();
      EXPECT_EQ(clients.failures().size(), 0u);
      for (const std::string& f : clients.failures()) ADD_FAILURE() << f;
      EXPECT_EQ(clients.wrong(), 0);
      EXPECT_GT(clients.answered(), 20u);
      if (HasFailure()) ADD_FAILURE() << "seed " << clients.seed() << "\n" << (*server)->Log();
    }
    (*server)->Stop(SIGTERM, absl::Seconds(15)).IgnoreError();
    // Some batches found their rows on the device already.
    const std::string log = (*server)->Log();
    const std::string said = "worker 0: the rows of ";
    const size_t at = log.find(said);
    ASSERT_NE(at, std::string::npos) << log;
    EXPECT_GT(std::atoi(log.c_str() + at + said.size()), 0) << log.substr(at, 120);
    std::cerr << log.substr(at, log.find('\n', at) - at) << "\n";
  }

  const absl::Time start = absl::Now();
  absl::StatusOr<std::pair<int, std::string>> r =
      ServerProcess::RunToExit(3, {"--device-exchange=cuda"}, absl::Seconds(120));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("--device-exchange=cuda: "), std::string::npos) << r->second;
  EXPECT_LT(absl::Now() - start, absl::Seconds(50)) << "a worker waited out the rendezvous";
  r = ServerProcess::RunToExit(3, {"--device-exchange=sideways"}, absl::Seconds(120));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("--device-exchange must be auto, off, host or cuda; got 'sideways'"),
            std::string::npos)
      << r->second;
}

// Rebalancing while serving: 4 clients verify every answer against the reference while the
// server rebalances every few batches (--eplb-min-gain=0: whenever the placement for the
// window's loads differs); nothing fails, nothing is wrong, and rebalances happened.
TEST(Rebalance, UnderFourVerifyingClientsNothingIsLost) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(3, {"--max-batch-tokens=32", "--max-queue-delay-us=500",
                               "--redundant-experts=3", "--eplb-interval=4", "--eplb-min-gain=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  VerifyingClients clients(**server);
  // At least 8 s of load, and on until a rebalance is done (at most 40 s: a slow machine).
  const absl::Time start = absl::Now();
  const std::string done = "epserve_eplb_rebalances_total{outcome=\"done\"}";
  while (absl::Now() - start < absl::Seconds(8) ||
         (absl::Now() - start < absl::Seconds(40) &&
          MetricValue(HttpGet((*server)->metrics_address(), "/metrics"), done) < 1)) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  clients.Stop();
  const std::string metrics = HttpGet((*server)->metrics_address(), "/metrics");
  EXPECT_EQ(clients.failures().size(), 0u);
  for (const std::string& f : clients.failures()) ADD_FAILURE() << f;
  EXPECT_EQ(clients.wrong(), 0);
  EXPECT_GT(clients.answered(), 40u);
  EXPECT_GE(MetricValue(metrics, "epserve_eplb_rebalances_total{outcome=\"done\"}"), 1) << metrics;
  EXPECT_EQ(MetricValue(metrics, "epserve_eplb_rebalances_total{outcome=\"failed\"}"), 0);
  EXPECT_GT(MetricValue(metrics, "epserve_eplb_loaded_bytes_total"), 0);
  std::cerr << clients.answered() << " answers checked; rebalances done "
            << MetricValue(metrics, "epserve_eplb_rebalances_total{outcome=\"done\"}")
            << ", skipped "
            << MetricValue(metrics, "epserve_eplb_rebalances_total{outcome=\"skipped\"}") << "\n";
  if (HasFailure()) ADD_FAILURE() << "seed " << clients.seed() << "\n" << (*server)->Log();
  (*server)->Stop(SIGTERM, absl::Seconds(15)).IgnoreError();
}

TEST(PlacementFlags, BadValuesAreClearErrors) {
  // More copies than workers can hold, and a profile of another model.
  absl::StatusOr<std::pair<int, std::string>> r =
      ServerProcess::RunToExit(3, {"--redundant-experts=9"}, absl::Seconds(120));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("--redundant-experts must be in [0, experts x (workers - 1) = 8]"),
            std::string::npos)
      << r->second;
  const std::string path = ::testing::TempDir() + "/other_profile.json";
  std::ofstream(path) << "{\"num_experts\": 4, \"layers\": {\"0\": [1, 2, 3, 4]}}";
  r = ServerProcess::RunToExit(3, {"--eplb-profile=" + path}, absl::Seconds(120));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("--eplb-profile is of a model with 4 experts; the served one has 8"),
            std::string::npos)
      << r->second;
  // Two copies of each expert need as many redundant copies as experts.
  r = ServerProcess::RunToExit(3, {"--redundant-experts=4", "--eplb-min-copies=2"},
                               absl::Seconds(120));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("--eplb-min-copies=2 needs --redundant-experts >= experts x (2 - 1) "
                           "= 8, got 4"),
            std::string::npos)
      << r->second;
}

}  // namespace
}  // namespace epserve::testing
