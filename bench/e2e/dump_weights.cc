// Writes one MoE layer's weights (a synthetic preset's, or a checkpoint's) as .npy files,
// FP32, in Hugging Face's layout, so that other frameworks run the very weights the server
// serves:
//   router.npy [E, H]; gate.npy, up.npy [E, F, H]; down.npy [E, H, F];
//   shared_gate.npy, shared_up.npy [Fs, H]; shared_down.npy [H, Fs];
//   shared_expert_gate.npy [1, H] (the last four only where the layer has them);
//   config.json: hidden, ffn, experts, top_k, norm_topk_prob, routing, shared_ffn,
//   shared_expert_gate.
//
//   bench_e2e_dump_weights --model=synthetic:qwen1.5-moe-a2.7b --seed=0 --out=DIR
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/flags.h"
#include "model/synthetic.h"
#include "model/weights.h"

namespace epserve::bench {
namespace {

// A .npy (format 1.0) header for a little-endian float32 C-order array of `shape`.
std::string NpyHeader(const std::vector<int64_t>& shape) {
  std::string dict = absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (",
                                  absl::StrJoin(shape, ", "), shape.size() == 1 ? ",), }" : "), }");
  // magic (6) + version (2) + length (2) + dict + padding + '\n', a multiple of 64.
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(dict.size() & 0xFF);
  out += static_cast<char>((dict.size() >> 8) & 0xFF);
  return out + dict;
}

// Writes `count` tensors of `kind` (one per expert when per_expert) stacked.
bool Dump(const model::WeightSource& source, int layer, model::TensorKind kind, int count,
          const std::string& path) {
  const model::TensorShape shape = model::ShapeOf(source.config().layer, kind);
  if (shape.numel() == 0) return true;
  std::vector<int64_t> dims = {shape.rows, shape.cols};
  if (count > 1) dims.insert(dims.begin(), count);
  std::ofstream out(path, std::ios::binary);
  out << NpyHeader(dims);
  std::vector<float> buf(static_cast<size_t>(shape.numel()));
  for (int e = 0; e < count; ++e) {
    if (absl::Status s = source.Fill(layer, kind, count > 1 ? e : 0, buf.data()); !s.ok()) {
      std::fprintf(stderr, "%s: %s\n", path.c_str(), std::string(s.message()).c_str());
      return false;
    }
    out.write(reinterpret_cast<const char*>(buf.data()),
              static_cast<std::streamsize>(buf.size() * sizeof(float)));
  }
  return static_cast<bool>(out);
}

int Run(int argc, char** argv) {
  std::string model_spec = "synthetic:tiny";
  std::string out_dir;
  int64_t seed = 0;
  common::FlagSet fs("bench_e2e_dump_weights",
                     "Writes one MoE layer's weights as .npy files (FP32, Hugging Face layout).");
  fs.Add("model", &model_spec, "synthetic:<preset> or a checkpoint folder");
  fs.Add("seed", &seed, "Seed of the synthetic weights (the server's --seed)");
  fs.Add("out", &out_dir, "Folder to write into (created)");
  if (absl::Status s = fs.Parse(argc, argv); !s.ok() || out_dir.empty()) {
    std::fprintf(stderr, "%s\n", s.ok() ? "--out is required" : std::string(s.message()).c_str());
    return 1;
  }
  if (fs.help_requested()) {
    std::printf("%s", fs.Usage().c_str());
    return 0;
  }
  auto source = model::OpenModel(model_spec, static_cast<uint64_t>(seed));
  if (!source.ok()) {
    std::fprintf(stderr, "%s\n", std::string(source.status().message()).c_str());
    return 1;
  }
  mkdir(out_dir.c_str(), 0755);
  const model::ModelConfig& config = (*source)->config();
  const model::MoeLayerConfig& c = config.layer;
  const int layer = config.moe_layers.front();
  using K = model::TensorKind;
  const struct {
    K kind;
    int count;
    const char* name;
  } tensors[] = {
      {K::kRouter, 1, "router"},           {K::kExpertGate, c.num_experts, "gate"},
      {K::kExpertUp, c.num_experts, "up"}, {K::kExpertDown, c.num_experts, "down"},
      {K::kSharedGate, 1, "shared_gate"},  {K::kSharedUp, 1, "shared_up"},
      {K::kSharedDown, 1, "shared_down"},  {K::kSharedExpertGate, 1, "shared_expert_gate"}};
  for (const auto& t : tensors) {
    if (!Dump(**source, layer, t.kind, t.count, absl::StrCat(out_dir, "/", t.name, ".npy"))) {
      return 1;
    }
  }
  std::ofstream json(absl::StrCat(out_dir, "/config.json"));
  json << "{\"model\": \"" << model_spec << "\", \"seed\": " << seed << ", \"layer\": " << layer
       << ", \"hidden\": " << c.hidden_size << ", \"ffn\": " << c.expert_ffn_size
       << ", \"experts\": " << c.num_experts << ", \"top_k\": " << c.top_k
       << ", \"norm_topk_prob\": " << (c.norm_topk_prob ? "true" : "false") << ", \"routing\": \""
       << model::RoutingKindName(c.routing) << "\", \"shared_ffn\": " << c.shared_ffn_size
       << ", \"shared_expert_gate\": " << (c.shared_expert_gate ? "true" : "false") << "}\n";
  return json ? 0 : 1;
}

}  // namespace
}  // namespace epserve::bench

int main(int argc, char** argv) { return epserve::bench::Run(argc, argv); }
