// Writes small Hugging Face checkpoints (config.json + safetensors, single-file or sharded)
// of every family CheckpointWeights reads, with known values, for tests: the model tests
// compare what OpenModel loads against them, end-to-end tests serve them through a cluster.
// Not thread-safe; each call writes its own folder.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/moe_config.h"
#include "model/weights.h"

namespace epserve::model::testing {

enum class Family { kMixtral, kQwen2Moe, kQwen3Moe, kDeepseekV2, kDeepseekV3, kOlmoe };
absl::string_view FamilyName(Family family);  // config.json model_type, e.g. "qwen2_moe"

struct CheckpointSpec {
  Family family = Family::kMixtral;
  std::string dtype = "BF16";  // stored dtype of every tensor: F32, BF16 or F16
  int num_shards = 1;          // 1: model.safetensors; more: shards + index.json
  int64_t hidden_size = 64;
  int64_t expert_ffn_size = 32;  // per routed expert
  int num_experts = 4;
  int top_k = 2;
  int num_layers = 2;
  // Leading dense layers: DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers.
  int dense_layers = 0;
  bool norm_topk_prob = true;  // not written for Mixtral (it always renormalises)
  // Qwen2-MoE: the shared expert's intermediate size (with a shared_expert_gate).
  int64_t shared_ffn_size = 48;
  // DeepSeek: shared experts, fused to n_shared_experts * expert_ffn_size.
  int n_shared_experts = 1;
  int n_group = 1;  // DeepSeek
  int topk_group = 1;
  double routed_scaling_factor = 1.0;
  uint64_t seed = 1;

  // Raw JSON values replacing or adding config.json keys; an empty value removes the key.
  std::map<std::string, std::string> config_overrides;
  // Tensors left out of the files and of the index.
  std::set<std::string> omit_tensors;
  // Tensor name -> dtype stored instead of `dtype`. Any safetensors dtype name; those other
  // than F32/BF16/F16 are written as zero bytes.
  std::map<std::string, std::string> tensor_dtypes;
  // Tensor name -> shape written instead of the right one (values sized to match).
  std::map<std::string, std::vector<int64_t>> tensor_shapes;
};

struct WrittenCheckpoint {
  std::string folder;
  std::vector<int> moe_layers;
  std::vector<int> dense_layers;
  MoeLayerConfig layer_config;     // the served layer shape and routing config.json describes
  std::vector<std::string> files;  // safetensors files, relative to folder
  // Every tensor written (MoE or not) -> the values as stored, decoded to FP32, and its file.
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::string> file_of;

  // The checkpoint's name for (layer, kind, expert); empty for a kind this family lacks.
  std::string TensorName(int layer, TensorKind kind, int expert) const;
  // The written values of MoE layer `layer` (empty vectors for absent kinds).
  LayerWeights Layer(int layer) const;
  Family family = Family::kMixtral;
};

// Writes `spec` into `folder` (created if needed; existing files are overwritten).
absl::StatusOr<WrittenCheckpoint> WriteCheckpoint(const CheckpointSpec& spec,
                                                  const std::string& folder);

// One tensor as raw bytes, for hand-made (and malformed) files.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;  // little-endian elements
};
// Writes a safetensors file: header (offsets laid out in order, padded to 8 bytes) + data.
absl::Status WriteSafetensors(const std::string& path, const std::vector<RawTensor>& tensors);
// Writes a file of the 8-byte length, `header` verbatim and `data`: whatever it claims.
absl::Status WriteRawSafetensors(const std::string& path, absl::string_view header,
                                 absl::string_view data);
// `values` in `dtype` (F32, BF16, F16: round to nearest even), little-endian.
std::string EncodeValues(const std::vector<float>& values, absl::string_view dtype);
// What `v` reads back as after a round trip through `dtype`.
float RoundTrip(float v, absl::string_view dtype);

}  // namespace epserve::model::testing
