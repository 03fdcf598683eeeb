// Helpers of the end-to-end tests: random token rows, requests, and the reference answer
// of synthetic:tiny (seed 0, as the server runs it).
#pragma once

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "grpc_service.pb.h"
#include "model/reference.h"
#include "model/synthetic.h"

namespace epserve::testing {

inline constexpr int64_t kHidden = 64;  // synthetic:tiny

inline std::vector<float> RandomRows(int64_t tokens, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(tokens * kHidden);
  for (float& v : x) v = u(rng);
  return x;
}

// A ModelInfer request for model "moe" with x [tokens, hidden] as FP32 hidden_states.
inline inference::ModelInferRequest Request(const std::vector<float>& x, int64_t tokens,
                                            std::string id = "", int64_t hidden = kHidden) {
  inference::ModelInferRequest req;
  req.set_model_name("moe");
  req.set_id(std::move(id));
  auto* in = req.add_inputs();
  in->set_name("hidden_states");
  in->set_datatype("FP32");
  in->add_shape(tokens);
  in->add_shape(hidden);
  req.add_raw_input_contents(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  return req;
}

// The reference output of the tiny model (seed 0, as the server runs it).
class Reference {
 public:
  Reference() : source_(*model::OpenModel("synthetic:tiny", 0)) {
    for (int layer : source_->config().moe_layers)
      layers_.push_back(*model::LoadLayer(*source_, layer));
  }
  // Max relative error of `out` against the reference; near-tie tokens skipped.
  double RelError(const std::vector<float>& x, const float* out, int64_t tokens,
                  int layer_pos = 0) {
    std::vector<float> ref(x.size());
    model::Routing routing;
    model::ReferenceForward(source_->config().layer, layers_[layer_pos], x.data(), tokens,
                            ref.data(), &routing);
    double err = 0, scale = 1e-30;
    for (int64_t t = 0; t < tokens; ++t) {
      if (routing.margins[t] < 1e-5) continue;
      for (int64_t i = 0; i < kHidden; ++i) {
        const double o = out[t * kHidden + i];
        if (!std::isfinite(o)) return INFINITY;
        err = std::max(err, std::abs(o - ref[t * kHidden + i]));
        scale = std::max(scale, std::abs(static_cast<double>(ref[t * kHidden + i])));
      }
    }
    return err / scale;
  }
  // The reference routing of x [tokens, H] through served layer `layer_pos`.
  model::Routing Route(const std::vector<float>& x, int64_t tokens, int layer_pos = 0) {
    return model::ReferenceRoute(source_->config().layer, layers_[layer_pos], x.data(), tokens);
  }

 private:
  std::unique_ptr<model::WeightSource> source_;
  std::vector<model::LayerWeights> layers_;
};

}  // namespace epserve::testing
