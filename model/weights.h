// Where the weights of MoE layers come from. Tensors use Hugging Face's layout:
// a projection from K to N inputs is stored row-major as [N, K].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/moe_config.h"

namespace epserve::model {

enum class TensorKind {
  kRouter,            // [E, H]
  kRouterBias,        // [E] correction bias, kSigmoidGroupedTopK only
  kExpertGate,        // [F, H] per routed expert
  kExpertUp,          // [F, H] per routed expert
  kExpertDown,        // [H, F] per routed expert
  kSharedGate,        // [Fs, H]
  kSharedUp,          // [Fs, H]
  kSharedDown,        // [H, Fs]
  kSharedExpertGate,  // [1, H] the sigmoid gate of the shared expert
};

absl::string_view TensorKindName(TensorKind kind);

// Rows and columns of a tensor of `kind` in a layer of shape `cfg`.
struct TensorShape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t numel() const { return rows * cols; }
};
TensorShape ShapeOf(const MoeLayerConfig& cfg, TensorKind kind);

// A source of weights. Implementations are thread-safe for concurrent Fill calls.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const ModelConfig& config() const = 0;
  // Writes tensor `kind` of `layer` (and `expert` for per-expert kinds, else 0) into
  // `dst`, which holds ShapeOf(config().layer, kind).numel() floats.
  virtual absl::Status Fill(int layer, TensorKind kind, int expert, float* dst) const = 0;
};

// All weights of one layer in host memory, FP32. For tests and the reference path;
// workers load only the experts they own straight into device buffers.
struct LayerWeights {
  std::vector<float> router;                                                   // [E, H]
  std::vector<float> router_bias;                                              // [E] or empty
  std::vector<std::vector<float>> gate, up, down;                              // per expert
  std::vector<float> shared_gate, shared_up, shared_down, shared_expert_gate;  // or empty
};
absl::StatusOr<LayerWeights> LoadLayer(const WeightSource& source, int layer);

}  // namespace epserve::model
