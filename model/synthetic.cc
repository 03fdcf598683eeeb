#include "model/synthetic.h"

#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "model/checkpoint.h"
#include "model/detail/json.h"

namespace epserve::model {
namespace {

struct Preset {
  const char* name;
  std::vector<int> layers;
  MoeLayerConfig layer;
};

MoeLayerConfig Layer(int64_t h, int64_t f, int e, int k, bool norm, int64_t shared, bool gate) {
  MoeLayerConfig c;
  c.hidden_size = h;
  c.expert_ffn_size = f;
  c.num_experts = e;
  c.top_k = k;
  c.norm_topk_prob = norm;
  c.shared_ffn_size = shared;
  c.shared_expert_gate = gate;
  return c;
}

std::vector<Preset> Presets() {
  std::vector<Preset> p;
  // For tests: two layers, a gated shared expert, softmax top-2 of 8.
  p.push_back({"tiny", {0, 1}, Layer(64, 32, 8, 2, false, 64, true)});
  // For tests: DeepSeek-V3 routing in small (16 experts in 4 groups, top-4 of 2 groups).
  MoeLayerConfig grouped = Layer(64, 32, 16, 4, true, 32, false);
  grouped.routing = RoutingKind::kSigmoidGroupedTopK;
  grouped.n_group = 4;
  grouped.topk_group = 2;
  grouped.routed_scaling_factor = 2.5f;
  p.push_back({"tiny-grouped", {0}, grouped});
  // For tests: DeepSeek-V2 routing in small (softmax top-4 of 16 experts, limited to the 2
  // of 4 groups with the best max-probability expert, scaled).
  MoeLayerConfig limited = Layer(64, 32, 16, 4, false, 0, false);
  limited.n_group = 4;
  limited.topk_group = 2;
  limited.routed_scaling_factor = 2.0f;
  p.push_back({"tiny-group-limited", {0}, limited});
  // For tests: gpt-oss routing in small.
  MoeLayerConfig topk_softmax = Layer(64, 48, 8, 2, false, 0, false);
  topk_softmax.routing = RoutingKind::kTopKSoftmax;
  p.push_back({"tiny-topk-softmax", {0}, topk_softmax});
  // Real models' MoE layer shapes (one layer each, to fit the memory of small machines).
  p.push_back({"qwen1.5-moe-a2.7b", {0}, Layer(2048, 1408, 60, 4, false, 5632, true)});
  p.push_back({"mixtral-8x7b", {0}, Layer(4096, 14336, 8, 2, true, 0, false)});
  p.push_back({"olmoe-1b-7b", {0}, Layer(2048, 1024, 64, 8, false, 0, false)});
  p.push_back({"deepseek-v2-lite", {1}, Layer(2048, 1408, 64, 6, false, 2816, false)});
  return p;
}

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

std::vector<std::string> SyntheticPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : Presets()) names.push_back(p.name);
  return names;
}

absl::StatusOr<ModelConfig> SyntheticPreset(absl::string_view name) {
  for (const Preset& p : Presets()) {
    if (name == p.name) {
      ModelConfig c;
      c.source = absl::StrCat("synthetic:", name);
      c.architecture = p.name;
      c.moe_layers = p.layers;
      c.layer = p.layer;
      c.num_layers = p.layers.back() + 1;
      return c;
    }
  }
  return absl::NotFoundError(absl::StrCat("unknown synthetic preset '", name, "'; presets: ",
                                          absl::StrJoin(SyntheticPresetNames(), ", ")));
}

SyntheticWeights::SyntheticWeights(ModelConfig config, uint64_t seed)
    : config_(std::move(config)), seed_(seed) {}

absl::Status SyntheticWeights::Fill(int layer, TensorKind kind, int expert, float* dst) const {
  const TensorShape shape = ShapeOf(config_.layer, kind);
  const bool per_expert = kind == TensorKind::kExpertGate || kind == TensorKind::kExpertUp ||
                          kind == TensorKind::kExpertDown;
  if (per_expert && (expert < 0 || expert >= config_.layer.num_experts)) {
    return absl::OutOfRangeError(
        absl::StrCat("expert ", expert, " not in [0, ", config_.layer.num_experts, ")"));
  }
  const uint64_t base = Mix(Mix(Mix(seed_ ^ 0x6570736572766531ULL) + static_cast<uint64_t>(layer)) +
                            (static_cast<uint64_t>(kind) << 32 | static_cast<uint32_t>(expert)));
  // Router bias: small offsets comparable to the spread of sigmoid scores.
  const float scale = kind == TensorKind::kRouterBias
                          ? 0.1f
                          : 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(shape.cols, 1)));
  const int64_t n = shape.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t z = Mix(base + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ULL);
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = (2.0f * u - 1.0f) * scale;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(absl::string_view spec, uint64_t seed) {
  constexpr absl::string_view kSynthetic = "synthetic:";
  if (!absl::StartsWith(spec, kSynthetic)) {
    if (spec.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model must be synthetic:<preset> (presets: ",
          absl::StrJoin(SyntheticPresetNames(), ", "), ") or a Hugging Face checkpoint folder"));
    }
    EPSERVE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWeights> checkpoint,
                             CheckpointWeights::Open(spec));
    return std::unique_ptr<WeightSource>(std::move(checkpoint));
  }
  EPSERVE_ASSIGN_OR_RETURN(ModelConfig config, SyntheticPreset(spec.substr(kSynthetic.size())));
  if (absl::Status s = config.layer.Validate(); !s.ok()) return s;
  return std::make_unique<SyntheticWeights>(std::move(config), seed);
}

absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view json) {
  absl::StatusOr<detail::Json> parsed = detail::ParseJson(json);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) {
    return absl::InvalidArgumentError(
        "a model spec is a JSON object: {\"model\": \"<folder or synthetic:preset>\", \"seed\": "
        "N}");
  }
  ModelSpec spec;
  for (const auto& [key, value] : parsed->members()) {
    if (key == "model" && value.is_string() && !value.string().empty()) {
      spec.model = value.string();
    } else if (key == "seed" && value.is_integer() && value.integer() >= 0) {
      spec.seed = static_cast<uint64_t>(value.integer());
    } else if (key == "model" || key == "seed") {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec member '", key, "' must be ",
                       key == "model" ? "a non-empty string" : "an integer >= 0"));
    } else {
      return absl::InvalidArgumentError(absl::StrCat("model spec member '", key.substr(0, 64),
                                                     "' is unknown (members: model, seed)"));
    }
  }
  if (spec.model.empty()) {
    return absl::InvalidArgumentError("a model spec needs the member 'model'");
  }
  return spec;
}

}  // namespace epserve::model
