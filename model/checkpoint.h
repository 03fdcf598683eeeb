// Hugging Face checkpoints: a folder with config.json and model.safetensors (or shards listed
// by model.safetensors.index.json). Supported families (config.json "model_type", else the
// first known "architectures" entry):
//   mixtral      MixtralForCausalLM     block_sparse_moe.{gate, experts.E.w1/w3/w2}
//   qwen2_moe    Qwen2MoeForCausalLM    mlp.{gate, experts.E.*_proj, shared_expert.*_proj,
//                                       shared_expert_gate}
//   qwen3_moe    Qwen3MoeForCausalLM    mlp.{gate, experts.E.*_proj}
//   deepseek_v2  DeepseekV2ForCausalLM  mlp.{gate, experts.E.*_proj, shared_experts.*_proj}
//   deepseek_v3  DeepseekV3ForCausalLM  as V2 plus mlp.gate.e_score_correction_bias
//   olmoe        OlmoeForCausalLM       mlp.{gate, experts.E.*_proj}
// Tensors stored as F32, BF16 or F16 are converted to FP32 by Fill. Everything else (an
// unknown family, a missing tensor, a shape that disagrees with config.json, a truncated
// file, a lying header, an unsupported dtype, a quantized checkpoint) fails Open with an
// error naming the file and, where one is at fault, the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/weights.h"

namespace epserve::model {

namespace detail {
class SafetensorsFile;
struct TensorEntry;
}  // namespace detail

// What config.json said beyond the served layer shape, for tools and logs.
struct CheckpointFacts {
  std::string folder;
  std::string model_type;                  // e.g. "deepseek_v3"
  std::vector<std::string> architectures;  // e.g. {"DeepseekV3ForCausalLM"}
  std::vector<int> dense_layers;           // decoder layers with a dense MLP, ascending
  std::string scoring_func;                // "softmax" or "sigmoid"
  std::string topk_method;                 // DeepSeek's, else empty
  int n_shared_experts = 0;                // DeepSeek's, fused into shared_ffn_size
  std::vector<std::string> files;          // safetensors files opened, relative to folder
  // Stored dtype of the served tensors -> how many tensors (per layer and expert) use it.
  std::map<std::string, int64_t> stored_dtypes;
  int64_t stored_bytes = 0;  // bytes of the served tensors as stored
};

// The weights of a checkpoint folder, memory-mapped read-only: Fill converts one tensor, so
// a worker touches only the pages of the experts it owns and no full copy is ever made.
// Immutable after Open; Fill is thread-safe.
class CheckpointWeights final : public WeightSource {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointWeights>> Open(absl::string_view folder);
  ~CheckpointWeights() override;

  const ModelConfig& config() const override { return config_; }
  // See WeightSource. OUT_OF_RANGE for a layer that is not an MoE layer or a bad expert.
  absl::Status Fill(int layer, TensorKind kind, int expert, float* dst) const override;

  const CheckpointFacts& facts() const { return facts_; }
  // The checkpoint's name for tensor (layer, kind, expert), e.g.
  // "model.layers.3.mlp.experts.7.down_proj.weight"; empty for a kind this model lacks.
  std::string TensorName(int layer, TensorKind kind, int expert) const;

 private:
  struct Ref {
    const detail::SafetensorsFile* file = nullptr;
    const detail::TensorEntry* entry = nullptr;
  };
  struct LayerRefs {
    Ref router, router_bias, shared_gate, shared_up, shared_down, shared_expert_gate;
    std::vector<Ref> gate, up, down;  // per expert
  };
  CheckpointWeights() = default;
  // Steps of Open, in order: OpenFiles maps the safetensors files of facts_.folder (through
  // OpenIndexedFiles when sharded), Index finds every served tensor in them and checks it.
  absl::Status OpenFiles();
  absl::Status OpenIndexedFiles(const std::string& index_path);
  absl::Status Index();
  const Ref* Lookup(int layer, TensorKind kind, int expert, absl::Status* error) const;

  ModelConfig config_;
  CheckpointFacts facts_;
  int family_ = 0;
  std::vector<std::unique_ptr<detail::SafetensorsFile>> files_;
  std::map<std::string, const detail::SafetensorsFile*> weight_map_;  // tensor -> shard
  std::string index_file_;  // the index's name when sharded, else empty
  std::map<int, LayerRefs> layers_;
};

}  // namespace epserve::model
