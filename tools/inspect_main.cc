// epserve-inspect: what epserve would serve from a model, and the memory each worker needs.
//   epserve-inspect /models/DeepSeek-V2-Lite --workers 4 [--layers 1-8]
//   epserve-inspect synthetic:qwen1.5-moe-a2.7b
// Exit status: 0 described, 1 the model cannot be served (the error names file and tensor),
// 2 bad command line.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/flags.h"
#include "model/checkpoint.h"
#include "model/layers.h"
#include "model/memory.h"
#include "model/synthetic.h"
#include "worker/placement.h"

namespace {

using namespace epserve;

std::string Range(int first, int count) {
  if (count == 1) return absl::StrCat(first);
  return absl::StrCat(first, "-", first + count - 1);
}

// The routing line: the kind and its settings, with the checkpoint's own names for them.
std::string RoutingText(const model::MoeLayerConfig& c,
                        const model::CheckpointWeights* checkpoint) {
  std::string routing = absl::StrCat(model::RoutingKindName(c.routing), ", norm_topk_prob ",
                                     c.norm_topk_prob ? "true" : "false",
                                     ", routed_scaling_factor ", c.routed_scaling_factor);
  if (c.routing == model::RoutingKind::kSigmoidGroupedTopK)
    absl::StrAppend(&routing, ", n_group ", c.n_group, ", topk_group ", c.topk_group,
                    ", with e_score_correction_bias");
  if (checkpoint != nullptr) {
    const model::CheckpointFacts& f = checkpoint->facts();
    absl::StrAppend(&routing, " (scoring_func ", f.scoring_func,
                    f.topk_method.empty() ? "" : absl::StrCat(", topk_method ", f.topk_method),
                    ")");
  }
  return routing;
}

// The shared-expert line: its size, how many experts it fuses, its gate; or "none".
std::string SharedExpertText(const model::MoeLayerConfig& c,
                             const model::CheckpointWeights* checkpoint) {
  if (c.shared_ffn_size <= 0) return "none";
  std::string shared = absl::StrCat("intermediate ", c.shared_ffn_size);
  if (checkpoint != nullptr && checkpoint->facts().n_shared_experts > 0)
    absl::StrAppend(&shared, " (", checkpoint->facts().n_shared_experts, " fused)");
  if (c.shared_expert_gate) absl::StrAppend(&shared, ", sigmoid-gated (shared_expert_gate)");
  return shared;
}

// The stored dtypes and files of a checkpoint (a synthetic model has none).
void PrintStorage(const model::CheckpointWeights* checkpoint) {
  if (checkpoint == nullptr) {
    std::printf("  stored dtypes:  none (synthetic, generated as FP32)\n");
    return;
  }
  const model::CheckpointFacts& f = checkpoint->facts();
  std::vector<std::string> dtypes;
  for (const auto& [dtype, count] : f.stored_dtypes)
    dtypes.push_back(absl::StrCat(dtype, " x", count));
  std::printf("  stored dtypes:  %s (%s of MoE tensors)\n", absl::StrJoin(dtypes, ", ").c_str(),
              model::FormatBytes(f.stored_bytes).c_str());
  std::printf("  files:          %s\n", absl::StrJoin(f.files, ", ").c_str());
}

// What the model is: architecture, layers, shapes, routing, shared expert, storage.
void DescribeModel(const model::WeightSource& source, const std::vector<int>& served) {
  const model::ModelConfig& config = source.config();
  const model::MoeLayerConfig& c = config.layer;
  const auto* checkpoint = dynamic_cast<const model::CheckpointWeights*>(&source);
  std::printf("model %s\n", config.source.c_str());
  if (checkpoint != nullptr) {
    const model::CheckpointFacts& f = checkpoint->facts();
    std::printf("  architecture:   %s (%s)\n", f.model_type.c_str(),
                absl::StrJoin(f.architectures, ", ").c_str());
  } else {
    std::printf("  architecture:   %s\n", config.architecture.c_str());
  }
  std::printf("  layers:         %d (num_hidden_layers)\n", config.num_layers);
  std::printf("  MoE layers:     %s (%zu)\n", model::FormatLayers(config.moe_layers).c_str(),
              config.moe_layers.size());
  if (checkpoint != nullptr) {
    std::printf("  dense layers:   %s\n",
                model::FormatLayers(checkpoint->facts().dense_layers).c_str());
  }
  std::printf("  served layers:  %s\n", model::FormatLayers(served).c_str());
  std::printf("  hidden size:    %ld\n", static_cast<long>(c.hidden_size));
  std::printf(
      "  experts:        %d routed, top-%d; each SwiGLU gate/up [%ld, %ld], down [%ld, %ld]\n",
      c.num_experts, c.top_k, static_cast<long>(c.expert_ffn_size),
      static_cast<long>(c.hidden_size), static_cast<long>(c.hidden_size),
      static_cast<long>(c.expert_ffn_size));
  std::printf("  routing:        %s\n", RoutingText(c, checkpoint).c_str());
  std::printf("  shared expert:  %s\n", SharedExpertText(c, checkpoint).c_str());
  PrintStorage(checkpoint);
}

// The weight memory of each worker rank serving `served` over `workers` workers, and the
// total.
void DescribeMemory(const model::ModelConfig& config, const std::vector<int>& served, int workers,
                    bool shared_split, int redundant) {
  model::ModelConfig served_config = config;
  served_config.moe_layers = served;
  std::printf(
      "memory per worker rank, %d worker(s), %zu served layer(s), %d redundant expert(s) per "
      "layer (router + held experts + %s):\n",
      workers, served.size(), redundant,
      shared_split ? "its slice of the shared expert" : "the whole shared expert");
  int64_t total_fp32 = 0, total_bf16 = 0;
  for (int w = 0; w < workers; ++w) {
    absl::StatusOr<model::RankMemory> m =
        model::EstimateRankBytes(served_config, workers, w, shared_split, redundant);
    if (!m.ok()) {
      std::printf("  %s\n", std::string(m.status().message()).c_str());
      return;
    }
    total_fp32 += m->fp32_bytes();
    total_bf16 += m->bf16_bytes();
    const std::string who =
        absl::StrCat("worker ", w, " (rank ", worker::RankOfWorker(w), "): experts ",
                     m->first_expert < 0 ? absl::StrCat(m->num_experts, " (as placed)")
                                         : Range(m->first_expert, m->num_experts));
    std::printf("  %-36s FP32 %-10s BF16 %s\n", who.c_str(),
                model::FormatBytes(m->fp32_bytes()).c_str(),
                model::FormatBytes(m->bf16_bytes()).c_str());
  }
  std::printf("  %-36s FP32 %-10s BF16 %s\n", "all workers", model::FormatBytes(total_fp32).c_str(),
              model::FormatBytes(total_bf16).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string spec;
  int workers = 1;
  std::string layers = "all";
  std::string shared_expert = "split";
  int redundant = 0;
  epserve::common::FlagSet fs(
      "epserve-inspect",
      "Describes a model as epserve would serve it and the weight memory of each worker.\n"
      "  epserve-inspect <checkpoint folder | synthetic:<preset>> [flags]");
  fs.Add("model", &spec, "The model, instead of the first argument");
  fs.Add("workers", &workers, "Worker ranks to spread the experts over (mpirun -np 1+W)");
  fs.Add("layers", &layers, "Served MoE layers: all, 3, 1,5, 2-7 or a mix");
  fs.Add("redundant-experts", &redundant,
         "As epserve's flag: copies of experts beyond one each, per layer");
  fs.Add("shared-expert", &shared_expert,
         "As epserve's flag: split (each worker holds 1/W of the shared expert) or owner");
  // The first argument, when not a flag, names the model; FlagSet takes flags only.
  std::vector<char*> args(argv, argv + argc);
  if (argc > 1 && argv[1][0] != '-') {
    spec = argv[1];
    args.erase(args.begin() + 1);
  }
  if (absl::Status s = fs.Parse(static_cast<int>(args.size()), args.data()); !s.ok()) {
    std::fprintf(stderr, "epserve-inspect: %s\n%s", std::string(s.message()).c_str(),
                 fs.Usage().c_str());
    return 2;
  }
  if (fs.help_requested()) {
    std::printf("%s", fs.Usage().c_str());
    return 0;
  }
  if (shared_expert != "split" && shared_expert != "owner") {
    std::fprintf(stderr, "epserve-inspect: --shared-expert must be split or owner, got '%s'\n",
                 shared_expert.c_str());
    return 2;
  }
  if (spec.empty()) {
    std::fprintf(stderr, "epserve-inspect: name a model\n%s", fs.Usage().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<epserve::model::WeightSource>> source =
      epserve::model::OpenModel(spec, 0);
  if (!source.ok()) {
    std::fprintf(stderr, "epserve-inspect: %s\n", source.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::vector<int>> served =
      epserve::model::SelectLayers((*source)->config(), layers);
  if (!served.ok()) {
    std::fprintf(stderr, "epserve-inspect: %s\n", served.status().ToString().c_str());
    return 2;
  }
  const int num_experts = (*source)->config().layer.num_experts;
  if (workers < 1 || workers > num_experts) {
    std::fprintf(stderr,
                 "epserve-inspect: --workers must be in [1, %d] (one expert at least each)\n",
                 num_experts);
    return 2;
  }
  DescribeModel(**source, *served);
  DescribeMemory((*source)->config(), *served, workers, shared_expert == "split", redundant);
  return 0;
}
