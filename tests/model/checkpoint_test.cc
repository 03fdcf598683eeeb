// Hugging Face checkpoints: every family round-trips through the writer and OpenModel, and
// every malformed checkpoint fails at open with the file and the tensor named.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "model/checkpoint.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "tests/model/checkpoint_writer.h"

namespace epserve::model {
namespace {

using testing::CheckpointSpec;
using testing::Family;
using testing::WriteCheckpoint;
using testing::WrittenCheckpoint;

std::string Folder(absl::string_view name) {
  return absl::StrCat(::testing::TempDir(), "/epserve_ckpt_", getpid(), "_", name);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// ---------------------------------------------------------------------------------------
// Round trips

struct Case {
  std::string name;
  CheckpointSpec spec;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  auto add = [&](std::string name, Family family, std::string dtype, int shards, auto&& tweak) {
    CheckpointSpec s;
    s.family = family;
    s.dtype = std::move(dtype);
    s.num_shards = shards;
    s.seed = cases.size() + 11;
    tweak(s);
    cases.push_back({std::move(name), s});
  };
  add("MixtralBf16Single", Family::kMixtral, "BF16", 1,
      [](CheckpointSpec& s) { s.num_layers = 3; });
  add("MixtralF32Sharded", Family::kMixtral, "F32", 3, [](CheckpointSpec&) {});
  add("Qwen2MoeBf16Sharded", Family::kQwen2Moe, "BF16", 2, [](CheckpointSpec& s) {
    s.num_layers = 3;
    s.dense_layers = 1;
    s.norm_topk_prob = false;
  });
  add("Qwen2MoeF16Single", Family::kQwen2Moe, "F16", 1,
      [](CheckpointSpec& s) { s.num_experts = 6; });
  add("Qwen3MoeF32Single", Family::kQwen3Moe, "F32", 1, [](CheckpointSpec& s) { s.top_k = 3; });
  add("DeepseekV2Bf16Sharded", Family::kDeepseekV2, "BF16", 2, [](CheckpointSpec& s) {
    s.num_layers = 3;
    s.dense_layers = 1;
    s.n_shared_experts = 2;
    s.norm_topk_prob = false;
    s.routed_scaling_factor = 2.0;
  });
  add("DeepseekV3Bf16Sharded", Family::kDeepseekV3, "BF16", 3, [](CheckpointSpec& s) {
    s.num_layers = 3;
    s.dense_layers = 1;
    s.num_experts = 8;
    s.n_group = 4;
    s.topk_group = 2;
    s.routed_scaling_factor = 2.5;
  });
  add("DeepseekV3F16Single", Family::kDeepseekV3, "F16", 1, [](CheckpointSpec& s) {
    s.dense_layers = 1;
    s.num_experts = 8;
    s.n_group = 2;
    s.topk_group = 1;
    s.norm_topk_prob = false;
  });
  add("OlmoeF16Single", Family::kOlmoe, "F16", 1, [](CheckpointSpec& s) {
    s.num_experts = 8;
    s.norm_topk_prob = false;
  });
  add("OlmoeBf16Sharded", Family::kOlmoe, "BF16", 2, [](CheckpointSpec&) {});
  return cases;
}

class RoundTrip : public ::testing::TestWithParam<Case> {};

TEST_P(RoundTrip, LoadsExactlyTheWrittenValuesAndForwardsLikeInMemoryWeights) {
  const Case& c = GetParam();
  absl::StatusOr<WrittenCheckpoint> w = WriteCheckpoint(c.spec, Folder(c.name));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenModel(w->folder, 0);
  ASSERT_TRUE(source.ok()) << source.status();
  const ModelConfig& cfg = (*source)->config();
  EXPECT_EQ(cfg.architecture, testing::FamilyName(c.spec.family));
  EXPECT_EQ(cfg.moe_layers, w->moe_layers);
  EXPECT_EQ(cfg.num_layers, c.spec.num_layers);
  const MoeLayerConfig& got = cfg.layer;
  const MoeLayerConfig& want = w->layer_config;
  EXPECT_EQ(got.hidden_size, want.hidden_size);
  EXPECT_EQ(got.expert_ffn_size, want.expert_ffn_size);
  EXPECT_EQ(got.num_experts, want.num_experts);
  EXPECT_EQ(got.top_k, want.top_k);
  EXPECT_EQ(got.routing, want.routing);
  EXPECT_EQ(got.norm_topk_prob, want.norm_topk_prob);
  EXPECT_EQ(got.n_group, want.n_group);
  EXPECT_EQ(got.topk_group, want.topk_group);
  EXPECT_FLOAT_EQ(got.routed_scaling_factor, want.routed_scaling_factor);
  EXPECT_EQ(got.shared_ffn_size, want.shared_ffn_size);
  EXPECT_EQ(got.shared_expert_gate, want.shared_expert_gate);

  const auto* checkpoint = dynamic_cast<const CheckpointWeights*>(source->get());
  ASSERT_NE(checkpoint, nullptr);
  EXPECT_EQ(checkpoint->facts().dense_layers, w->dense_layers);
  EXPECT_EQ(checkpoint->facts().files.size(), static_cast<size_t>(c.spec.num_shards));
  EXPECT_GT(checkpoint->facts().stored_dtypes.count(c.spec.dtype), 0u);

  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t tokens = 16;
  std::vector<float> x(tokens * got.hidden_size);
  for (float& v : x) v = u(rng);
  for (int layer : cfg.moe_layers) {
    SCOPED_TRACE(absl::StrCat("layer ", layer));
    absl::StatusOr<LayerWeights> loaded = LoadLayer(**source, layer);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const LayerWeights expected = w->Layer(layer);
    ASSERT_FALSE(expected.router.empty());
    EXPECT_EQ(loaded->router, expected.router);
    EXPECT_EQ(loaded->router_bias, expected.router_bias);
    EXPECT_EQ(loaded->gate, expected.gate);
    EXPECT_EQ(loaded->up, expected.up);
    EXPECT_EQ(loaded->down, expected.down);
    EXPECT_EQ(loaded->shared_gate, expected.shared_gate);
    EXPECT_EQ(loaded->shared_up, expected.shared_up);
    EXPECT_EQ(loaded->shared_down, expected.shared_down);
    EXPECT_EQ(loaded->shared_expert_gate, expected.shared_expert_gate);
    EXPECT_EQ(checkpoint->TensorName(layer, TensorKind::kExpertDown, 1),
              w->TensorName(layer, TensorKind::kExpertDown, 1));

    std::vector<float> y_checkpoint(x.size(), NAN), y_memory(x.size(), NAN);
    Routing r_checkpoint, r_memory;
    ReferenceForward(got, *loaded, x.data(), tokens, y_checkpoint.data(), &r_checkpoint);
    ReferenceForward(want, expected, x.data(), tokens, y_memory.data(), &r_memory);
    EXPECT_EQ(r_checkpoint.ids, r_memory.ids);
    EXPECT_EQ(r_checkpoint.weights, r_memory.weights);
    EXPECT_EQ(y_checkpoint, y_memory);
    for (float v : y_checkpoint) ASSERT_TRUE(std::isfinite(v));
  }
  std::filesystem::remove_all(w->folder);
}

INSTANTIATE_TEST_SUITE_P(Families, RoundTrip, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

TEST(Checkpoint, FillIsThreadSafeAndRejectsDenseLayersAndBadExperts) {
  CheckpointSpec spec;
  spec.family = Family::kDeepseekV2;
  spec.dense_layers = 1;
  spec.num_layers = 2;
  spec.num_experts = 8;
  absl::StatusOr<WrittenCheckpoint> w = WriteCheckpoint(spec, Folder("threads"));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<CheckpointWeights>> c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t n = ShapeOf((*c)->config().layer, TensorKind::kExpertUp).numel();
  std::vector<float> dst(n);
  EXPECT_EQ((*c)->Fill(0, TensorKind::kExpertUp, 0, dst.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*c)->Fill(1, TensorKind::kExpertUp, 8, dst.data()).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*c)->Fill(1, TensorKind::kExpertUp, -1, dst.data()).code(),
            absl::StatusCode::kOutOfRange);
  std::vector<int> mismatches(2, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> buf(n);
      for (int round = 0; round < 20; ++round)
        for (int e = 0; e < 8; ++e) {
          if (!(*c)->Fill(1, TensorKind::kExpertUp, e, buf.data()).ok() ||
              buf != w->values.at(w->TensorName(1, TensorKind::kExpertUp, e)))
            ++mismatches[t];
        }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches, (std::vector<int>{0, 0}));
  std::filesystem::remove_all(w->folder);
}

// ---------------------------------------------------------------------------------------
// Config semantics

TEST(Checkpoint, QwenSparseStepAndMlpOnlyLayersPickTheMoeLayers) {
  CheckpointSpec spec;
  spec.family = Family::kQwen2Moe;
  spec.num_layers = 6;
  spec.config_overrides = {{"decoder_sparse_step", "2"}, {"mlp_only_layers", "[3]"}};
  absl::StatusOr<WrittenCheckpoint> w = WriteCheckpoint(spec, Folder("qwen_step"));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<CheckpointWeights>> c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  // (layer + 1) % 2 == 0 and not in mlp_only_layers: 1, 5.
  EXPECT_EQ((*c)->config().moe_layers, (std::vector<int>{1, 5}));
  EXPECT_EQ((*c)->facts().dense_layers, (std::vector<int>{0, 2, 3, 4}));
  std::filesystem::remove_all(w->folder);
}

TEST(Checkpoint, Qwen3ExpertCountUnderEitherName) {
  // transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
  CheckpointSpec spec;
  spec.family = Family::kQwen3Moe;
  spec.num_experts = 6;
  spec.config_overrides = {{"num_experts", ""}, {"num_local_experts", "6"}};
  absl::StatusOr<WrittenCheckpoint> w = WriteCheckpoint(spec, Folder("qwen3_local"));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<CheckpointWeights>> c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->config().layer.num_experts, 6);
  // With neither, the error names the published key.
  spec.config_overrides = {{"num_experts", ""}};
  w = WriteCheckpoint(spec, Folder("qwen3_local"));
  ASSERT_TRUE(w.ok()) << w.status();
  c = CheckpointWeights::Open(w->folder);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("\"num_experts\" is missing"), absl::string_view::npos)
      << c.status();
  std::filesystem::remove_all(w->folder);
}

TEST(Checkpoint, DeepseekV2RenormalisesOrScalesNeverBoth) {
  CheckpointSpec spec;
  spec.family = Family::kDeepseekV2;
  spec.routed_scaling_factor = 16.0;
  spec.norm_topk_prob = false;
  absl::StatusOr<WrittenCheckpoint> w = WriteCheckpoint(spec, Folder("v2_scale"));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::unique_ptr<CheckpointWeights>> c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE((*c)->config().layer.norm_topk_prob);
  EXPECT_FLOAT_EQ((*c)->config().layer.routed_scaling_factor, 16.0f);
  EXPECT_EQ((*c)->config().layer.routing, RoutingKind::kSoftmaxTopK);
  spec.norm_topk_prob = true;
  w = WriteCheckpoint(spec, Folder("v2_scale"));
  ASSERT_TRUE(w.ok()) << w.status();
  c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->config().layer.norm_topk_prob);
  EXPECT_FLOAT_EQ((*c)->config().layer.routed_scaling_factor, 1.0f);
  // group_limited_greedy that keeps every group is plain greedy top-k.
  spec.config_overrides = {
      {"topk_method", "\"group_limited_greedy\""}, {"n_group", "2"}, {"topk_group", "2"}};
  w = WriteCheckpoint(spec, Folder("v2_scale"));
  ASSERT_TRUE(w.ok()) << w.status();
  c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->config().layer.n_group, 1);
  // Keeping fewer groups limits the top-k to them (DeepSeek-V2's gate).
  spec.num_experts = 8;
  spec.config_overrides = {
      {"topk_method", "\"group_limited_greedy\""}, {"n_group", "4"}, {"topk_group", "2"}};
  w = WriteCheckpoint(spec, Folder("v2_scale"));
  ASSERT_TRUE(w.ok()) << w.status();
  c = CheckpointWeights::Open(w->folder);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->config().layer.routing, RoutingKind::kSoftmaxTopK);
  EXPECT_EQ((*c)->config().layer.n_group, 4);
  EXPECT_EQ((*c)->config().layer.topk_group, 2);
  std::filesystem::remove_all(w->folder);
}

// ---------------------------------------------------------------------------------------
// Rejected checkpoints: the error names the file and, where one is at fault, the tensor.

class Rejects : public ::testing::Test {
 protected:
  // Writes `spec` and returns the status of opening it.
  absl::Status Open(const CheckpointSpec& spec) {
    absl::StatusOr<WrittenCheckpoint> w = WriteCheckpoint(spec, folder_);
    EXPECT_TRUE(w.ok()) << w.status();
    if (w.ok()) written_ = *w;
    return Reopen();
  }
  absl::Status Reopen() {
    absl::StatusOr<std::unique_ptr<WeightSource>> s = OpenModel(folder_, 0);
    return s.ok() ? absl::OkStatus() : s.status();
  }
  void TearDown() override { std::filesystem::remove_all(folder_); }

  static void ExpectMentions(const absl::Status& s, std::vector<std::string> parts) {
    ASSERT_FALSE(s.ok());
    for (const std::string& p : parts)
      EXPECT_NE(s.message().find(p), absl::string_view::npos) << "'" << p << "' not in: " << s;
  }

  std::string folder_ = Folder(::testing::UnitTest::GetInstance()->current_test_info()->name());
  WrittenCheckpoint written_;
};

constexpr char kMixtralW3[] = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
constexpr char kMixtralW1[] = "model.layers.0.block_sparse_moe.experts.1.w1.weight";

TEST_F(Rejects, MissingFolderOrConfig) {
  absl::StatusOr<std::unique_ptr<WeightSource>> s = OpenModel(folder_ + "/nope", 0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  ExpectMentions(s.status(), {"nope/config.json"});
}

TEST_F(Rejects, UnknownArchitecture) {
  CheckpointSpec spec;
  spec.config_overrides = {{"model_type", "\"llama\""},
                           {"architectures", "[\"LlamaForCausalLM\"]"}};
  absl::Status s = Open(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ExpectMentions(
      s, {"config.json", "unsupported architecture", "llama", "LlamaForCausalLM", "mixtral"});
}

TEST_F(Rejects, ConfigThatIsNotJson) {
  CheckpointSpec spec;
  ASSERT_TRUE(WriteCheckpoint(spec, folder_).ok());
  Spit(folder_ + "/config.json", "{\"model_type\": \"mixtral\",}");
  ExpectMentions(Reopen(), {"config.json", "JSON error at byte"});
}

TEST_F(Rejects, ConfigKeyOfTheWrongTypeOrMissing) {
  CheckpointSpec spec;
  spec.config_overrides = {{"num_local_experts", "\"eight\""}};
  ExpectMentions(Open(spec), {"config.json", "\"num_local_experts\"", "integer"});
  spec.config_overrides = {{"num_experts_per_tok", ""}};
  ExpectMentions(Open(spec), {"config.json", "\"num_experts_per_tok\" is missing"});
  spec.config_overrides = {{"hidden_act", "\"gelu\""}};
  ExpectMentions(Open(spec), {"config.json", "hidden_act", "gelu"});
}

TEST_F(Rejects, QuantizedCheckpoint) {
  CheckpointSpec spec;
  spec.family = Family::kDeepseekV3;
  spec.num_experts = 8;
  spec.n_group = 2;
  spec.config_overrides = {{"quantization_config", "{\"quant_method\": \"fp8\"}"}};
  ExpectMentions(Open(spec), {"config.json", "quantized", "fp8"});
}

TEST_F(Rejects, RoutingNoRoutingKindExpressesOrBadGroups) {
  CheckpointSpec spec;
  spec.family = Family::kDeepseekV2;
  spec.num_experts = 8;
  spec.config_overrides = {
      {"topk_method", "\"group_limited_greedy\""}, {"n_group", "4"}, {"topk_group", "5"}};
  ExpectMentions(Open(spec), {"config.json", "topk_group", "[1, n_group]"});
  spec.config_overrides = {{"topk_method", "\"group_limited_greedy\""}, {"n_group", "3"}};
  ExpectMentions(Open(spec), {"n_group must divide num_experts=8, got 3"});
  spec.config_overrides = {{"topk_method", "\"device_limited\""}};
  ExpectMentions(Open(spec), {"config.json", "device_limited", "group_limited_greedy"});
  spec.family = Family::kDeepseekV3;
  spec.config_overrides = {{"scoring_func", "\"softmax\""}};
  ExpectMentions(Open(spec), {"config.json", "softmax", "noaux_tc"});
}

TEST_F(Rejects, MissingTensorInASingleFile) {
  CheckpointSpec spec;
  spec.omit_tensors = {kMixtralW3};
  absl::Status s = Open(spec);
  ExpectMentions(s, {folder_ + "/model.safetensors", kMixtralW3, "missing"});
}

TEST_F(Rejects, MissingTensorInTheIndex) {
  CheckpointSpec spec;
  spec.num_shards = 2;
  spec.omit_tensors = {kMixtralW3};
  ExpectMentions(Open(spec), {"model.safetensors.index.json", kMixtralW3, "weight_map"});
}

TEST_F(Rejects, IndexPointsToAShardWithoutTheTensor) {
  CheckpointSpec spec;
  spec.num_shards = 2;
  ASSERT_TRUE(Open(spec).ok());
  const std::string index_path = folder_ + "/model.safetensors.index.json";
  const std::string right = written_.file_of.at(kMixtralW3);
  const std::string wrong = right == written_.files[0] ? written_.files[1] : written_.files[0];
  Spit(index_path, absl::StrReplaceAll(Slurp(index_path),
                                       {{absl::StrCat("\"", kMixtralW3, "\": \"", right, "\""),
                                         absl::StrCat("\"", kMixtralW3, "\": \"", wrong, "\"")}}));
  ExpectMentions(Reopen(), {folder_ + "/" + wrong, kMixtralW3, "missing"});
}

TEST_F(Rejects, MissingShardFile) {
  CheckpointSpec spec;
  spec.num_shards = 2;
  ASSERT_TRUE(Open(spec).ok());
  std::filesystem::remove(folder_ + "/" + written_.files[1]);
  absl::Status s = Reopen();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  ExpectMentions(s, {written_.files[1], "model.safetensors.index.json", "tensor '"});
}

TEST_F(Rejects, ShapeThatDisagreesWithConfig) {
  CheckpointSpec spec;
  spec.tensor_shapes = {{kMixtralW1, {33, 64}}};
  ExpectMentions(Open(spec),
                 {"model.safetensors", kMixtralW1, "[33, 64]", "[32, 64]", "config.json"});
  // The same when config.json is what is wrong.
  spec.tensor_shapes.clear();
  spec.family = Family::kQwen3Moe;
  spec.config_overrides = {{"moe_intermediate_size", "16"}};
  ExpectMentions(Open(spec), {"model.safetensors", "model.layers.0.mlp.experts.0.gate_proj.weight",
                              "[32, 64]", "[16, 64]"});
}

TEST_F(Rejects, UnsupportedDtype) {
  CheckpointSpec spec;
  spec.tensor_dtypes = {{kMixtralW1, "I8"}};
  ExpectMentions(Open(spec), {"model.safetensors", kMixtralW1, "dtype I8"});
  spec.tensor_dtypes = {{kMixtralW1, "F8_E4M3"}};
  ExpectMentions(Open(spec), {"model.safetensors", kMixtralW1, "dtype F8_E4M3"});
}

TEST_F(Rejects, TruncatedFile) {
  CheckpointSpec spec;
  ASSERT_TRUE(Open(spec).ok());
  const std::string path = folder_ + "/model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  ExpectMentions(Reopen(), {path, "tensor '", "truncated"});
  std::filesystem::resize_file(path, 5);
  ExpectMentions(Reopen(), {path, "too short"});
}

// Rewrites the header of `path` through `edit`; the data stays as it was.
void EditHeader(const std::string& path, const std::function<std::string(std::string)>& edit) {
  const std::string bytes = Slurp(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  const std::string header = edit(bytes.substr(8, n));
  ASSERT_TRUE(testing::WriteRawSafetensors(path, header, bytes.substr(8 + n)).ok());
}

// The "data_offsets":[a,b] of `tensor` in `header`.
std::pair<uint64_t, uint64_t> OffsetsOf(const std::string& header, const std::string& tensor) {
  const size_t at = header.find(absl::StrCat("\"", tensor, "\""));
  const size_t off = header.find("\"data_offsets\":[", at) + 16;
  uint64_t a = 0, b = 0;
  std::sscanf(header.c_str() + off, "%lu,%lu", &a, &b);
  return {a, b};
}

std::string SetOffsets(std::string header, const std::string& tensor, uint64_t a, uint64_t b) {
  const auto [old_a, old_b] = OffsetsOf(header, tensor);
  const size_t at = header.find(absl::StrCat("\"", tensor, "\""));
  const size_t off = header.find("\"data_offsets\":[", at) + 16;
  const std::string old_text = absl::StrCat(old_a, ",", old_b, "]");
  return header.replace(off, old_text.size(), absl::StrCat(a, ",", b, "]"));
}

TEST_F(Rejects, HeaderThatLiesAboutSizes) {
  CheckpointSpec spec;
  ASSERT_TRUE(Open(spec).ok());
  const std::string path = folder_ + "/model.safetensors";
  EditHeader(path, [](std::string h) {
    const auto [a, b] = OffsetsOf(h, kMixtralW1);
    return SetOffsets(h, kMixtralW1, a, b - 2);
  });
  ExpectMentions(Reopen(), {path, kMixtralW1, "needs 4096"});
}

TEST_F(Rejects, OverlappingData) {
  CheckpointSpec spec;
  ASSERT_TRUE(Open(spec).ok());
  const std::string path = folder_ + "/model.safetensors";
  EditHeader(path, [](std::string h) {
    const auto [a, b] = OffsetsOf(h, kMixtralW1);
    return SetOffsets(h, kMixtralW1, a - 64, b - 64);
  });
  ExpectMentions(Reopen(), {path, "overlaps", kMixtralW1});
}

TEST_F(Rejects, DataOutsideTheFile) {
  CheckpointSpec spec;
  ASSERT_TRUE(Open(spec).ok());
  const std::string path = folder_ + "/model.safetensors";
  EditHeader(path, [](std::string h) {
    const auto [a, b] = OffsetsOf(h, kMixtralW1);
    return SetOffsets(h, kMixtralW1, a + 100000000, b + 100000000);
  });
  ExpectMentions(Reopen(), {path, kMixtralW1, "run past the end"});
}

TEST_F(Rejects, HeaderLongerThanTheFileOrNotJson) {
  CheckpointSpec spec;
  ASSERT_TRUE(Open(spec).ok());
  const std::string path = folder_ + "/model.safetensors";
  std::string bytes = Slurp(path);
  std::string lying = bytes;
  lying[6] = 1;  // header length += 2^48
  Spit(path, lying);
  ExpectMentions(Reopen(), {path, "header length"});
  std::string garbled = bytes;
  garbled[8] = '[';
  Spit(path, garbled);
  ExpectMentions(Reopen(), {path, "bad header"});
}

// ---------------------------------------------------------------------------------------
// The inspect tool, run as a user would.

#ifdef EPSERVE_INSPECT
std::pair<int, std::string> RunInspect(const std::string& args) {
  const std::string out = absl::StrCat(::testing::TempDir(), "/epserve_inspect_", getpid(), ".txt");
  const int status =
      std::system(absl::StrCat(EPSERVE_INSPECT, " ", args, " > ", out, " 2>&1").c_str());
  std::string text = Slurp(out);
  std::filesystem::remove(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

TEST(Inspect, DescribesACheckpointAndFailsOnABadOne) {
  CheckpointSpec spec;
  spec.family = Family::kDeepseekV3;
  spec.num_layers = 3;
  spec.dense_layers = 1;
  spec.num_experts = 8;
  spec.n_group = 4;
  spec.topk_group = 2;
  spec.num_shards = 2;
  const std::string folder = Folder("inspect");
  ASSERT_TRUE(WriteCheckpoint(spec, folder).ok());
  auto [code, text] = RunInspect(absl::StrCat(folder, " --workers 3"));
  EXPECT_EQ(code, 0) << text;
  for (const char* part :
       {"deepseek_v3", "DeepseekV3ForCausalLM", "MoE layers:     1-2 (2)", "dense layers:   0",
        "sigmoid_grouped_topk", "BF16", "F32", "worker 2 (rank 3): experts 5-7"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " not in:\n" << text;
  std::filesystem::remove(folder + "/model-00002-of-00002.safetensors");
  std::tie(code, text) = RunInspect(folder);
  EXPECT_EQ(code, 1) << text;
  EXPECT_NE(text.find("model-00002-of-00002.safetensors"), std::string::npos) << text;
  std::filesystem::remove_all(folder);
}

TEST(Inspect, CountsTheSharedExpertAsTheServerHoldsIt) {
  // qwen1.5-moe-a2.7b over 2 workers: router, 30 experts and the shared expert (whole, or
  // half of its 5632 columns), FP32; the server reports the same bytes when it loads them.
  auto [code, text] = RunInspect("synthetic:qwen1.5-moe-a2.7b --workers 2 --shared-expert owner");
  EXPECT_EQ(code, 0) << text;
  EXPECT_NE(text.find("whole shared expert"), std::string::npos) << text;
  EXPECT_NE(text.find("FP32 1.10 GiB"), std::string::npos) << text;  // 1177001984 B
  std::tie(code, text) = RunInspect("synthetic:qwen1.5-moe-a2.7b --workers 2");
  EXPECT_EQ(code, 0) << text;
  EXPECT_NE(text.find("its slice of the shared expert"), std::string::npos) << text;
  EXPECT_NE(text.find("FP32 1.03 GiB"), std::string::npos) << text;  // 1107795968 B
  std::tie(code, text) = RunInspect("synthetic:tiny --shared-expert both");
  EXPECT_EQ(code, 2) << text;
  EXPECT_NE(text.find("--shared-expert must be split or owner"), std::string::npos) << text;
}
#endif

}  // namespace
}  // namespace epserve::model
