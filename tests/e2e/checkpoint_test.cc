// Hugging Face checkpoints served through a whole cluster: each family written by the
// tests' checkpoint writer, every served layer answered and compared with the reference
// forward pass computed from the same files; --layers; memory that follows the experts.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <cmath>
#include <cstring>
#include <random>
#include <regex>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "tests/e2e/reference.h"
#include "tests/e2e/server_process.h"
#include "tests/model/checkpoint_writer.h"

namespace epserve::testing {
namespace {

using model::testing::CheckpointSpec;
using model::testing::Family;

std::string TempFolder() {
  char tmpl[] = "/tmp/epserve-ckpt-XXXXXX";
  return mkdtemp(tmpl);
}

// Sends `tokens` random rows to `layer`; the answer as floats, or the status on failure.
absl::StatusOr<std::vector<float>> Infer(inference::GRPCInferenceService::Stub& stub,
                                         const std::vector<float>& x, int64_t tokens,
                                         int64_t hidden, int layer) {
  inference::ModelInferRequest req = Request(x, tokens, /*id=*/"", hidden);
  (*req.mutable_parameters())["layer"].set_int64_param(layer);
  inference::ModelInferResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::Status s = stub.ModelInfer(&ctx, req, &resp);
  if (!s.ok())
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  std::vector<float> out(x.size());
  if (resp.raw_output_contents_size() != 1 ||
      resp.raw_output_contents(0).size() != out.size() * 4) {
    return absl::InternalError("malformed response");
  }
  std::memcpy(out.data(), resp.raw_output_contents(0).data(), out.size() * 4);
  return out;
}

// Max relative error against the reference through the same checkpoint (near ties skipped).
double RelError(const model::WeightSource& source, int layer, const std::vector<float>& x,
                const std::vector<float>& out, int64_t tokens) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  model::LayerWeights w = *model::LoadLayer(source, layer);
  std::vector<float> ref(x.size());
  model::Routing routing;
  model::ReferenceForward(cfg, w, x.data(), tokens, ref.data(), &routing);
  double err = 0, scale = 1e-30;
  for (int64_t t = 0; t < tokens; ++t) {
    if (routing.margins[t] < 1e-5) continue;
    for (int64_t i = 0; i < cfg.hidden_size; ++i) {
      const double o = out[t * cfg.hidden_size + i], r = ref[t * cfg.hidden_size + i];
      if (!std::isfinite(o)) return INFINITY;
      err = std::max(err, std::abs(o - r));
      scale = std::max(scale, std::abs(r));
    }
  }
  return err / scale;
}

struct Case {
  const char* name;
  Family family;
  const char* dtype;
  int shards;
  int dense_layers;
};

class ServeCheckpoint : public ::testing::TestWithParam<Case> {};

TEST_P(ServeCheckpoint, EveryLayerMatchesTheReferenceFromTheSameFiles) {
  const Case& c = GetParam();
  CheckpointSpec spec;
  spec.family = c.family;
  spec.dtype = c.dtype;
  spec.num_shards = c.shards;
  spec.num_layers = 3;
  spec.dense_layers = c.dense_layers;
  spec.num_experts = 8;
  spec.top_k = 2;
  spec.seed = std::random_device{}();
  if (c.family == Family::kDeepseekV3) {
    spec.n_group = 4;
    spec.topk_group = 2;
    spec.routed_scaling_factor = 2.5;
  }
  const std::string folder = TempFolder();
  absl::StatusOr<model::testing::WrittenCheckpoint> written =
      model::testing::WriteCheckpoint(spec, folder);
  ASSERT_TRUE(written.ok()) << written.status();
  absl::StatusOr<std::unique_ptr<model::WeightSource>> source = model::OpenModel(folder, 0);
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(3, {"--model=" + folder, "--max-batch-tokens=16"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->NewStub();
  std::mt19937_64 rng(spec.seed);
  std::uniform_real_distribution<float> u(-1, 1);
  const int64_t h = spec.hidden_size, tokens = 21;
  ASSERT_FALSE(written->moe_layers.empty());
  for (int layer : written->moe_layers) {
    std::vector<float> x(tokens * h);
    for (float& v : x) v = u(rng);
    absl::StatusOr<std::vector<float>> out = Infer(*stub, x, tokens, h, layer);
    ASSERT_TRUE(out.ok()) << "layer " << layer << ": " << out.status();
    EXPECT_LE(RelError(**source, layer, x, *out, tokens), 1e-4) << c.name << " layer " << layer;
  }
  for (int dense : written->dense_layers) {
    std::vector<float> x(h, 0.5f);
    EXPECT_EQ(Infer(*stub, x, 1, h, dense).status().code(), absl::StatusCode::kNotFound)
        << "dense layer " << dense;
  }
  EXPECT_TRUE((*server)->Stop(SIGTERM, absl::Seconds(15)).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Families, ServeCheckpoint,
    ::testing::Values(Case{"mixtral_bf16", Family::kMixtral, "BF16", 1, 0},
                      Case{"qwen2_moe_f32_sharded", Family::kQwen2Moe, "F32", 2, 1},
                      Case{"qwen3_moe_f16", Family::kQwen3Moe, "F16", 1, 0},
                      Case{"deepseek_v2_bf16_sharded", Family::kDeepseekV2, "BF16", 2, 1},
                      Case{"deepseek_v3_bf16", Family::kDeepseekV3, "BF16", 3, 1},
                      Case{"olmoe_f16", Family::kOlmoe, "F16", 1, 0}),
    [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

TEST(ServeCheckpointLayers, OnlyTheSelectedLayersAreServed) {
  CheckpointSpec spec;
  spec.family = Family::kMixtral;
  spec.num_layers = 3;
  const std::string folder = TempFolder();
  ASSERT_TRUE(model::testing::WriteCheckpoint(spec, folder).ok());
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(2, {"--model=" + folder, "--layers=1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->NewStub();
  std::vector<float> x(2 * spec.hidden_size, 0.25f);
  EXPECT_TRUE(Infer(*stub, x, 2, spec.hidden_size, 1).ok());
  absl::Status other = Infer(*stub, x, 2, spec.hidden_size, 0).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound) << other;
  EXPECT_NE(other.message().find("served: 1"), std::string::npos) << other;
}

TEST(ServeCheckpointErrors, BadCheckpointAndTooLittleMemoryStopTheStart) {
  CheckpointSpec spec;
  spec.family = Family::kOlmoe;
  spec.omit_tensors = {"model.layers.1.mlp.experts.2.up_proj.weight"};
  const std::string folder = TempFolder();
  ASSERT_TRUE(model::testing::WriteCheckpoint(spec, folder).ok());
  absl::StatusOr<std::pair<int, std::string>> r =
      ServerProcess::RunToExit(3, {"--model=" + folder}, absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("model.layers.1.mlp.experts.2.up_proj.weight"), std::string::npos)
      << r->second;
  r = ServerProcess::RunToExit(3, {"--memory-limit=100K"}, absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->first, 0);
  EXPECT_NE(r->second.find("--memory-limit is 100 KiB"), std::string::npos) << r->second;
}

// Resident bytes of each worker, as it logs them once its weights are loaded.
std::vector<double> WorkerResidentBytes(const std::string& log) {
  std::vector<double> rss;
  const std::regex re("resident ([0-9]+) bytes");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator();
       ++it) {
    rss.push_back(std::stod((*it)[1]));
  }
  return rss;
}

TEST(ServeCheckpointMemory, EachWorkerHoldsItsOwnExpertsOnly) {
  // 12 experts of 3 x 256 x 1024 F32 values: 3 MiB each, 36 MiB in all.
  CheckpointSpec spec;
  spec.family = Family::kMixtral;
  spec.dtype = "F32";
  spec.hidden_size = 256;
  spec.expert_ffn_size = 1024;
  spec.num_experts = 12;
  spec.num_layers = 1;
  const std::string folder = TempFolder();
  ASSERT_TRUE(model::testing::WriteCheckpoint(spec, folder).ok());
  const double expert_bytes = 3.0 * 256 * 1024 * 4;
  std::vector<double> one, three;
  for (int workers : {1, 3}) {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start(1 + workers, {"--model=" + folder});
    ASSERT_TRUE(server.ok()) << server.status();
    const std::vector<double> rss =
        WorkerResidentBytes((*server)->WaitForLog([&](const std::string& log) {
          return static_cast<int>(WorkerResidentBytes(log).size()) >= workers;
        }));
    ASSERT_EQ(static_cast<int>(rss.size()), workers) << (*server)->Log();
    (workers == 1 ? one : three) = rss;
  }
  double mean3 = 0;
  for (double r : three) mean3 += r / three.size();
  // One worker holds 12 experts, each of three holds 4: at least 8 experts' worth (counted
  // once; the device copy may double it) more for the single worker.
  std::cerr << "resident: 1 worker " << one[0] / (1 << 20) << " MiB; 3 workers "
            << mean3 / (1 << 20) << " MiB each (an expert is " << expert_bytes / (1 << 20)
            << " MiB)\n";
  EXPECT_GT(one[0] - mean3, 0.8 * 8 * expert_bytes);
  // ... and never more than twice the whole set (a checkpoint copy per rank would show).
  EXPECT_LT(one[0] - mean3, 2.5 * 8 * expert_bytes);
  for (double r : three) EXPECT_LT(std::abs(r - mean3), 2.0 * expert_bytes);
}

}  // namespace
}  // namespace epserve::testing
