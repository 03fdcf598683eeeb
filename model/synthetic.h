// Synthetic models: real models' MoE layer shapes with deterministic weights.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/weights.h"

namespace epserve::model {

// Names of the presets, e.g. "tiny", "qwen1.5-moe-a2.7b", "mixtral-8x7b".
std::vector<std::string> SyntheticPresetNames();

// The configuration of preset `name`; NOT_FOUND lists the presets.
absl::StatusOr<ModelConfig> SyntheticPreset(absl::string_view name);

// Weights of every tensor are a pure function of (seed, layer, tensor, expert, index):
// uniform in [-1, 1) / sqrt(fan_in), so any rank regenerates any expert on its own.
class SyntheticWeights final : public WeightSource {
 public:
  SyntheticWeights(ModelConfig config, uint64_t seed);
  const ModelConfig& config() const override { return config_; }
  absl::Status Fill(int layer, TensorKind kind, int expert, float* dst) const override;

 private:
  ModelConfig config_;
  uint64_t seed_;
};

// Opens `spec`: "synthetic:<preset>" (weights from `seed`), or else a Hugging Face checkpoint
// folder (CheckpointWeights::Open; `seed` unused). A folder that does not exist is NOT_FOUND,
// a malformed or unsupported checkpoint INVALID_ARGUMENT naming the file and the tensor.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(absl::string_view spec, uint64_t seed);

// Which weights to open: what --model and --seed name.
struct ModelSpec {
  std::string model;
  std::optional<uint64_t> seed;  // unset: the caller's default
};
// Parses {"model": "<folder or synthetic:preset>", "seed": <integer >= 0>} (seed optional,
// no other members); INVALID_ARGUMENT naming the member otherwise.
absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view json);

}  // namespace epserve::model
