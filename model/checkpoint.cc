#include "model/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "model/detail/config_reader.h"
#include "model/detail/json.h"
#include "model/detail/safetensors.h"

namespace epserve::model {
namespace {

using detail::ConfigReader;
using detail::Json;
using detail::SafetensorsFile;
using detail::TensorEntry;

enum Family { kMixtral, kQwen2Moe, kQwen3Moe, kDeepseekV2, kDeepseekV3, kOlmoe };

struct FamilyInfo {
  Family family;
  const char* model_type;
  const char* architecture;
};
constexpr FamilyInfo kFamilies[] = {
    {kMixtral, "mixtral", "MixtralForCausalLM"},
    {kQwen2Moe, "qwen2_moe", "Qwen2MoeForCausalLM"},
    {kQwen3Moe, "qwen3_moe", "Qwen3MoeForCausalLM"},
    {kDeepseekV2, "deepseek_v2", "DeepseekV2ForCausalLM"},
    {kDeepseekV3, "deepseek_v3", "DeepseekV3ForCausalLM"},
    {kOlmoe, "olmoe", "OlmoeForCausalLM"},
};

std::string SupportedList() {
  std::vector<std::string> names;
  for (const FamilyInfo& f : kFamilies)
    names.push_back(absl::StrCat(f.model_type, " (", f.architecture, ")"));
  return absl::StrJoin(names, ", ");
}

bool FileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string what = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(what) : absl::InvalidArgumentError(what);
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<Json> ReadJson(const std::string& path) {
  EPSERVE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  absl::StatusOr<Json> json = detail::ParseJson(text);
  if (!json.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", json.status().message()));
  if (!json->is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  return json;
}

// Reads the keys every family shares: the hidden size, the layer count, top-k, and the FFN
// form (SwiGLU without biases, the only one served).
absl::Status ReadCommonKeys(const ConfigReader& r, MoeLayerConfig* c, int* num_layers) {
  EPSERVE_ASSIGN_OR_RETURN(c->hidden_size, r.Count("hidden_size", true, 0));
  EPSERVE_ASSIGN_OR_RETURN(*num_layers, r.Count("num_hidden_layers", true, 0));
  EPSERVE_ASSIGN_OR_RETURN(c->top_k, r.Count("num_experts_per_tok", true, 0));
  std::string act;
  EPSERVE_ASSIGN_OR_RETURN(act, r.StringOr("hidden_act", "silu"));
  if (act != "silu") {
    return r.Error("hidden_act", absl::StrCat("is \"", act,
                                              "\"; experts are served as SwiGLU "
                                              "(silu) FFNs only"));
  }
  bool mlp_bias = false;
  EPSERVE_ASSIGN_OR_RETURN(mlp_bias, r.BoolOr("mlp_bias", false));
  if (mlp_bias)
    return r.Error("mlp_bias", "is true; expert projections with biases are not supported");
  return absl::OkStatus();
}

// Qwen2-MoE and Qwen3-MoE: the experts, which of the `num_layers` layers are sparse
// (decoder_sparse_step, mlp_only_layers) and Qwen2's gated shared expert.
absl::Status ReadQwenMoeKeys(const ConfigReader& r, Family family, int num_layers,
                             MoeLayerConfig* c, std::vector<bool>* is_moe) {
  // The published checkpoints say num_experts; transformers 5 saves Qwen3-MoE's count under
  // its attribute map's name, num_local_experts.
  const char* experts_key =
      r.Has("num_experts") || !r.Has("num_local_experts") ? "num_experts" : "num_local_experts";
  EPSERVE_ASSIGN_OR_RETURN(c->num_experts, r.Count(experts_key, true, 0));
  EPSERVE_ASSIGN_OR_RETURN(c->expert_ffn_size, r.Count("moe_intermediate_size", true, 0));
  EPSERVE_ASSIGN_OR_RETURN(c->norm_topk_prob, r.BoolOr("norm_topk_prob", false));
  int step = 1;
  EPSERVE_ASSIGN_OR_RETURN(step, r.Count("decoder_sparse_step", false, 1));
  std::vector<int64_t> mlp_only;
  EPSERVE_ASSIGN_OR_RETURN(mlp_only, r.IntListOr("mlp_only_layers"));
  for (int l = 0; l < num_layers; ++l) {
    const bool listed = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
    (*is_moe)[l] = !listed && (l + 1) % step == 0;
  }
  if (family == kQwen2Moe) {
    int64_t shared = 0;
    EPSERVE_ASSIGN_OR_RETURN(shared, r.IntOr("shared_expert_intermediate_size", 5632));
    if (shared < 0) return r.Error("shared_expert_intermediate_size", "must be >= 0");
    c->shared_ffn_size = shared;
    c->shared_expert_gate = shared > 0;
  }
  return absl::OkStatus();
}

// DeepSeek's gate (V3 when `v3`, else V2): softmax with greedy or group-limited greedy top-k,
// or sigmoid with grouped top-k (noaux_tc); any other pair of scoring_func and topk_method is
// an error.
// Needs c->top_k and c->num_experts read.
absl::Status ReadDeepseekRouting(const ConfigReader& r, bool v3, MoeLayerConfig* c,
                                 CheckpointFacts* facts) {
  bool norm = false;
  double scale = 1.0;
  EPSERVE_ASSIGN_OR_RETURN(norm, r.BoolOr("norm_topk_prob", v3));
  EPSERVE_ASSIGN_OR_RETURN(scale, r.NumberOr("routed_scaling_factor", v3 ? 2.5 : 1.0));
  EPSERVE_ASSIGN_OR_RETURN(facts->scoring_func,
                           r.StringOr("scoring_func", v3 ? "sigmoid" : "softmax"));
  EPSERVE_ASSIGN_OR_RETURN(facts->topk_method,
                           r.StringOr("topk_method", v3 ? "noaux_tc" : "greedy"));
  int64_t n_group = 0, topk_group = 0;
  EPSERVE_ASSIGN_OR_RETURN(n_group, r.IntOr("n_group", v3 ? 8 : 1));
  EPSERVE_ASSIGN_OR_RETURN(topk_group, r.IntOr("topk_group", v3 ? 4 : n_group));
  // DeepSeek's reference renormalises only for k > 1.
  norm = norm && c->top_k > 1;
  const std::string& scoring = facts->scoring_func;
  const std::string& method = facts->topk_method;
  const bool limited = method == "group_limited_greedy";
  if ((scoring == "sigmoid" && method == "noaux_tc") || limited) {
    if (n_group < 1 || n_group > c->num_experts)
      return r.Error("n_group", "must be in [1, n_routed_experts]");
    if (topk_group < 1 || topk_group > n_group)
      return r.Error("topk_group", "must be in [1, n_group]");
  }
  if (scoring == "softmax" && (method == "greedy" || limited)) {
    c->routing = RoutingKind::kSoftmaxTopK;
    c->norm_topk_prob = norm;
    // DeepSeek-V2's gate either renormalises or scales by routed_scaling_factor.
    c->routed_scaling_factor = norm ? 1.0f : static_cast<float>(scale);
    // group_limited_greedy: the top-k among the topk_group groups with the best
    // max-probability expert (keeping every group, plain greedy top-k).
    if (limited && topk_group < n_group) {
      c->n_group = static_cast<int>(n_group);
      c->topk_group = static_cast<int>(topk_group);
    }
  } else if (scoring == "sigmoid" && method == "noaux_tc") {
    c->routing = RoutingKind::kSigmoidGroupedTopK;
    c->norm_topk_prob = norm;
    c->routed_scaling_factor = static_cast<float>(scale);
    c->n_group = static_cast<int>(n_group);
    c->topk_group = static_cast<int>(topk_group);
  } else {
    return r.Error(
        "scoring_func",
        absl::StrCat(
            "is \"", scoring, "\" with topk_method \"", method,
            "\": supported are softmax with greedy or group_limited_greedy, and sigmoid with "
            "noaux_tc"));
  }
  return absl::OkStatus();
}

// DeepSeek-V2 and V3: the routed and shared experts (the shared ones fused into
// shared_ffn_size), which of the `num_layers` layers are sparse (first_k_dense_replace,
// moe_layer_freq), then the gate.
absl::Status ReadDeepseekKeys(const ConfigReader& r, Family family, int num_layers,
                              MoeLayerConfig* c, CheckpointFacts* facts,
                              std::vector<bool>* is_moe) {
  const bool v3 = family == kDeepseekV3;
  EPSERVE_ASSIGN_OR_RETURN(c->num_experts, r.Count("n_routed_experts", true, 0));
  EPSERVE_ASSIGN_OR_RETURN(c->expert_ffn_size, r.Count("moe_intermediate_size", true, 0));
  int64_t n_shared = 0;
  EPSERVE_ASSIGN_OR_RETURN(n_shared, r.IntOr("n_shared_experts", v3 ? 1 : 2));
  if (n_shared < 0) return r.Error("n_shared_experts", "must be >= 0");
  facts->n_shared_experts = static_cast<int>(n_shared);
  c->shared_ffn_size = n_shared * c->expert_ffn_size;
  int64_t first_dense = 0;
  int freq = 1;
  EPSERVE_ASSIGN_OR_RETURN(first_dense, r.IntOr("first_k_dense_replace", v3 ? 3 : 0));
  EPSERVE_ASSIGN_OR_RETURN(freq, r.Count("moe_layer_freq", false, 1));
  for (int l = 0; l < num_layers; ++l) (*is_moe)[l] = l >= first_dense && l % freq == 0;
  return ReadDeepseekRouting(r, v3, c, facts);
}

// Fills config->layer, config->moe_layers, config->num_layers and the routing facts from
// config.json of `family`.
absl::Status ReadModelConfig(const ConfigReader& r, Family family, ModelConfig* config,
                             CheckpointFacts* facts) {
  MoeLayerConfig& c = config->layer;
  int num_layers = 0;
  EPSERVE_RETURN_IF_ERROR(ReadCommonKeys(r, &c, &num_layers));
  std::vector<bool> is_moe(num_layers, true);
  facts->scoring_func = "softmax";

  switch (family) {
    case kMixtral: {
      EPSERVE_ASSIGN_OR_RETURN(c.num_experts, r.Count("num_local_experts", true, 0));
      EPSERVE_ASSIGN_OR_RETURN(c.expert_ffn_size, r.Count("intermediate_size", true, 0));
      c.routing = RoutingKind::kSoftmaxTopK;
      c.norm_topk_prob = true;  // Mixtral always renormalises the top-k probabilities
      break;
    }
    case kOlmoe: {
      EPSERVE_ASSIGN_OR_RETURN(c.num_experts, r.Count("num_experts", true, 0));
      EPSERVE_ASSIGN_OR_RETURN(c.expert_ffn_size, r.Count("intermediate_size", true, 0));
      EPSERVE_ASSIGN_OR_RETURN(c.norm_topk_prob, r.BoolOr("norm_topk_prob", false));
      break;
    }
    case kQwen2Moe:
    case kQwen3Moe:
      EPSERVE_RETURN_IF_ERROR(ReadQwenMoeKeys(r, family, num_layers, &c, &is_moe));
      break;
    case kDeepseekV2:
    case kDeepseekV3:
      EPSERVE_RETURN_IF_ERROR(ReadDeepseekKeys(r, family, num_layers, &c, facts, &is_moe));
      break;
  }
  config->num_layers = num_layers;
  config->moe_layers.clear();
  facts->dense_layers.clear();
  for (int l = 0; l < num_layers; ++l)
    (is_moe[l] ? config->moe_layers : facts->dense_layers).push_back(l);
  if (config->moe_layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.path(), ": no MoE layer among the ", num_layers, " layers"));
  }
  if (absl::Status s = c.Validate(); !s.ok())
    return absl::InvalidArgumentError(absl::StrCat(r.path(), ": ", s.message()));
  return absl::OkStatus();
}

// The family of config.json: its model_type when known, else its first known architecture.
// Records model_type and architectures in `facts` either way.
absl::StatusOr<const FamilyInfo*> FindFamily(const ConfigReader& r, CheckpointFacts* facts) {
  EPSERVE_ASSIGN_OR_RETURN(facts->model_type, r.StringOr("model_type", ""));
  EPSERVE_ASSIGN_OR_RETURN(facts->architectures, r.StringListOr("architectures"));
  const FamilyInfo* family = nullptr;
  for (const FamilyInfo& f : kFamilies)
    if (facts->model_type == f.model_type) family = &f;
  for (const std::string& arch : facts->architectures)
    for (const FamilyInfo& f : kFamilies)
      if (family == nullptr && arch == f.architecture) family = &f;
  if (family == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(r.path(), ": unsupported architecture (model_type \"", facts->model_type,
                     "\", architectures [", absl::StrJoin(facts->architectures, ", "),
                     "]); supported: ", SupportedList()));
  }
  return family;
}

// An error naming the quantization method when config.json (`root`, read from `path`) has a
// quantization_config.
absl::Status RefuseQuantized(const Json& root, const std::string& path) {
  const Json* q = root.Find("quantization_config");
  if (q == nullptr || q->is_null()) return absl::OkStatus();
  const Json* method = q->is_object() ? q->Find("quant_method") : nullptr;
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": quantized checkpoints are not supported (quantization_config",
                   method != nullptr && method->is_string()
                       ? absl::StrCat(".quant_method \"", method->string(), "\"")
                       : "",
                   "); use an F32, BF16 or F16 checkpoint"));
}

bool SafeRelativePath(absl::string_view p) {
  if (p.empty() || p[0] == '/') return false;
  for (absl::string_view part : absl::StrSplit(p, '/'))
    if (part == ".." || part.empty()) return false;
  return true;
}

}  // namespace

CheckpointWeights::~CheckpointWeights() = default;

absl::StatusOr<std::unique_ptr<CheckpointWeights>> CheckpointWeights::Open(
    absl::string_view folder_in) {
  std::string folder(folder_in);
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  std::unique_ptr<CheckpointWeights> w(new CheckpointWeights());
  w->facts_.folder = folder;
  const std::string config_path = folder + "/config.json";
  EPSERVE_ASSIGN_OR_RETURN(Json root, ReadJson(config_path));
  ConfigReader r(root, config_path);
  EPSERVE_ASSIGN_OR_RETURN(const FamilyInfo* family, FindFamily(r, &w->facts_));
  EPSERVE_RETURN_IF_ERROR(RefuseQuantized(root, config_path));
  w->family_ = family->family;
  w->config_.source = folder;
  w->config_.architecture = family->model_type;
  EPSERVE_RETURN_IF_ERROR(ReadModelConfig(r, family->family, &w->config_, &w->facts_));
  EPSERVE_RETURN_IF_ERROR(w->OpenFiles());
  EPSERVE_RETURN_IF_ERROR(w->Index());
  return w;
}

absl::Status CheckpointWeights::OpenFiles() {
  const std::string& folder = facts_.folder;
  const std::string index_path = folder + "/model.safetensors.index.json";
  const std::string single_path = folder + "/model.safetensors";
  if (FileExists(index_path)) {
    index_file_ = "model.safetensors.index.json";
    return OpenIndexedFiles(index_path);
  }
  if (FileExists(single_path)) {
    EPSERVE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f,
                             SafetensorsFile::Open(single_path));
    facts_.files.push_back("model.safetensors");
    files_.push_back(std::move(f));
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(
      folder, ": neither model.safetensors nor model.safetensors.index.json is there"));
}

absl::Status CheckpointWeights::OpenIndexedFiles(const std::string& index_path) {
  EPSERVE_ASSIGN_OR_RETURN(Json index, ReadJson(index_path));
  const Json* map = index.Find("weight_map");
  if (map == nullptr || !map->is_object())
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": no \"weight_map\" object"));
  std::map<std::string, const SafetensorsFile*> opened;
  for (const auto& [tensor, file] : map->members()) {
    if (!file.is_string() || !SafeRelativePath(file.string())) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": tensor '", tensor, "': weight_map entry is not a file in the folder"));
    }
    auto it = opened.find(file.string());
    if (it == opened.end()) {
      absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
          SafetensorsFile::Open(facts_.folder + "/" + file.string());
      if (!f.ok()) {
        return absl::Status(f.status().code(),
                            absl::StrCat(f.status().message(), " (listed in ", index_path,
                                         " for tensor '", tensor, "')"));
      }
      facts_.files.push_back(file.string());
      it = opened.emplace(file.string(), f->get()).first;
      files_.push_back(*std::move(f));
    }
    weight_map_[tensor] = it->second;
  }
  return absl::OkStatus();
}

std::string CheckpointWeights::TensorName(int layer, TensorKind kind, int expert) const {
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const bool mixtral = family_ == kMixtral;
  const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
  const std::string e = absl::StrCat(moe, "experts.", expert, ".");
  const std::string shared = family_ == kQwen2Moe ? "mlp.shared_expert." : "mlp.shared_experts.";
  switch (kind) {
    case TensorKind::kRouter:
      return absl::StrCat(p, moe, "gate.weight");
    case TensorKind::kRouterBias:
      return config_.layer.routing == RoutingKind::kSigmoidGroupedTopK
                 ? absl::StrCat(p, "mlp.gate.e_score_correction_bias")
                 : "";
    case TensorKind::kExpertGate:
      return absl::StrCat(p, e, mixtral ? "w1.weight" : "gate_proj.weight");
    case TensorKind::kExpertUp:
      return absl::StrCat(p, e, mixtral ? "w3.weight" : "up_proj.weight");
    case TensorKind::kExpertDown:
      return absl::StrCat(p, e, mixtral ? "w2.weight" : "down_proj.weight");
    case TensorKind::kSharedGate:
      return config_.layer.shared_ffn_size > 0 ? absl::StrCat(p, shared, "gate_proj.weight") : "";
    case TensorKind::kSharedUp:
      return config_.layer.shared_ffn_size > 0 ? absl::StrCat(p, shared, "up_proj.weight") : "";
    case TensorKind::kSharedDown:
      return config_.layer.shared_ffn_size > 0 ? absl::StrCat(p, shared, "down_proj.weight") : "";
    case TensorKind::kSharedExpertGate:
      return config_.layer.shared_expert_gate ? absl::StrCat(p, "mlp.shared_expert_gate.weight")
                                              : "";
  }
  return "";
}

absl::Status CheckpointWeights::Index() {
  const MoeLayerConfig& c = config_.layer;
  const std::string folder = facts_.folder;
  auto resolve = [&](int layer, TensorKind kind, int expert, Ref* ref) -> absl::Status {
    const std::string name = TensorName(layer, kind, expert);
    if (name.empty()) return absl::OkStatus();
    const SafetensorsFile* file = nullptr;
    if (index_file_.empty()) {
      file = files_.front().get();
    } else {
      auto it = weight_map_.find(name);
      if (it == weight_map_.end()) {
        const std::string fused = absl::StrCat("model.layers.", layer, ".mlp.experts.gate_up_proj");
        return absl::InvalidArgumentError(absl::StrCat(
            folder, "/", index_file_, ": tensor '", name, "' (layer ", layer, " ",
            TensorKindName(kind), ") is not in weight_map",
            weight_map_.count(fused) ? "; fused expert tensors (gate_up_proj) are not supported"
                                     : ""));
      }
      file = it->second;
    }
    const TensorEntry* entry = file->Find(name);
    if (entry == nullptr) {
      const bool fused =
          file->Find(absl::StrCat("model.layers.", layer, ".mlp.experts.gate_up_proj")) != nullptr;
      return absl::InvalidArgumentError(absl::StrCat(
          file->path(), ": tensor '", name, "' (layer ", layer, " ", TensorKindName(kind),
          ") is missing",
          index_file_.empty() ? "" : absl::StrCat(" though ", index_file_, " lists it here"),
          fused ? "; fused expert tensors (gate_up_proj) are not supported" : ""));
    }
    if (entry->dtype == detail::Dtype::kOther) {
      return absl::InvalidArgumentError(absl::StrCat(file->path(), ": tensor '", name, "': dtype ",
                                                     entry->dtype_name,
                                                     " is not supported (F32, F16, BF16)"));
    }
    const TensorShape want = ShapeOf(c, kind);
    std::vector<int64_t> expected = {want.rows, want.cols};
    if (kind == TensorKind::kRouterBias) expected = {want.cols};
    if (entry->shape != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          file->path(), ": tensor '", name, "': shape ", entry->ShapeString(),
          " disagrees with config.json, which implies [", absl::StrJoin(expected, ", "),
          "] (hidden_size=", c.hidden_size, ", experts=", c.num_experts, ", expert intermediate=",
          c.expert_ffn_size, ", shared intermediate=", c.shared_ffn_size, ")"));
    }
    ++facts_.stored_dtypes[entry->dtype_name];
    facts_.stored_bytes += static_cast<int64_t>(entry->end - entry->begin);
    ref->file = file;
    ref->entry = entry;
    return absl::OkStatus();
  };
  for (int layer : config_.moe_layers) {
    LayerRefs& l = layers_[layer];
    l.gate.resize(c.num_experts);
    l.up.resize(c.num_experts);
    l.down.resize(c.num_experts);
    const std::pair<TensorKind, Ref*> singles[] = {
        {TensorKind::kRouter, &l.router},
        {TensorKind::kRouterBias, &l.router_bias},
        {TensorKind::kSharedGate, &l.shared_gate},
        {TensorKind::kSharedUp, &l.shared_up},
        {TensorKind::kSharedDown, &l.shared_down},
        {TensorKind::kSharedExpertGate, &l.shared_expert_gate},
    };
    for (const auto& [kind, ref] : singles)
      if (absl::Status s = resolve(layer, kind, 0, ref); !s.ok()) return s;
    for (int e = 0; e < c.num_experts; ++e) {
      if (absl::Status s = resolve(layer, TensorKind::kExpertGate, e, &l.gate[e]); !s.ok())
        return s;
      if (absl::Status s = resolve(layer, TensorKind::kExpertUp, e, &l.up[e]); !s.ok()) return s;
      if (absl::Status s = resolve(layer, TensorKind::kExpertDown, e, &l.down[e]); !s.ok())
        return s;
    }
  }
  return absl::OkStatus();
}

const CheckpointWeights::Ref* CheckpointWeights::Lookup(int layer, TensorKind kind, int expert,
                                                        absl::Status* error) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    *error = absl::OutOfRangeError(
        absl::StrCat("layer ", layer, " is not an MoE layer of ", facts_.folder));
    return nullptr;
  }
  const LayerRefs& l = it->second;
  const bool per_expert = kind == TensorKind::kExpertGate || kind == TensorKind::kExpertUp ||
                          kind == TensorKind::kExpertDown;
  if (per_expert && (expert < 0 || expert >= config_.layer.num_experts)) {
    *error = absl::OutOfRangeError(
        absl::StrCat("expert ", expert, " not in [0, ", config_.layer.num_experts, ")"));
    return nullptr;
  }
  switch (kind) {
    case TensorKind::kRouter:
      return &l.router;
    case TensorKind::kRouterBias:
      return &l.router_bias;
    case TensorKind::kExpertGate:
      return &l.gate[expert];
    case TensorKind::kExpertUp:
      return &l.up[expert];
    case TensorKind::kExpertDown:
      return &l.down[expert];
    case TensorKind::kSharedGate:
      return &l.shared_gate;
    case TensorKind::kSharedUp:
      return &l.shared_up;
    case TensorKind::kSharedDown:
      return &l.shared_down;
    case TensorKind::kSharedExpertGate:
      return &l.shared_expert_gate;
  }
  *error = absl::InvalidArgumentError("unknown tensor kind");
  return nullptr;
}

absl::Status CheckpointWeights::Fill(int layer, TensorKind kind, int expert, float* dst) const {
  absl::Status error;
  const Ref* ref = Lookup(layer, kind, expert, &error);
  if (ref == nullptr) return error;
  if (ref->entry == nullptr) return absl::OkStatus();  // a kind this model lacks: 0 elements
  return ref->file->ReadAsFloat(*ref->entry, dst);
}

}  // namespace epserve::model
