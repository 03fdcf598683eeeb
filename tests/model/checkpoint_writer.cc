#include "tests/model/checkpoint_writer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/detail/safetensors.h"

namespace epserve::model::testing {
namespace {

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t HashName(absl::string_view s) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return h;
}

// Uniform in [-scale, scale), a pure function of (seed, name, index).
std::vector<float> Values(uint64_t seed, absl::string_view name, int64_t n, float scale) {
  std::vector<float> v(n);
  const uint64_t base = Mix(seed ^ HashName(name));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t z = Mix(base + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ULL);
    v[i] = (2.0f * static_cast<float>(z >> 40) / 16777216.0f - 1.0f) * scale;
  }
  return v;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool IsFloatDtype(absl::string_view dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16";
}

absl::Status WriteFile(const std::string& path, absl::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string Quote(absl::string_view s) { return absl::StrCat("\"", s, "\""); }

struct Planned {
  std::string name;
  std::vector<int64_t> shape;
  float scale;
};

}  // namespace

absl::string_view FamilyName(Family family) {
  switch (family) {
    case Family::kMixtral:
      return "mixtral";
    case Family::kQwen2Moe:
      return "qwen2_moe";
    case Family::kQwen3Moe:
      return "qwen3_moe";
    case Family::kDeepseekV2:
      return "deepseek_v2";
    case Family::kDeepseekV3:
      return "deepseek_v3";
    case Family::kOlmoe:
      return "olmoe";
  }
  return "unknown";
}

float RoundTrip(float v, absl::string_view dtype) {
  if (dtype == "BF16") return detail::Bf16ToFloat(detail::FloatToBf16(v));
  if (dtype == "F16") return detail::Fp16ToFloat(detail::FloatToFp16(v));
  return v;
}

std::string EncodeValues(const std::vector<float>& values, absl::string_view dtype) {
  std::string out;
  if (dtype == "F32") {
    out.resize(values.size() * 4);
    for (size_t i = 0; i < values.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &values[i], 4);
      for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<char>(u >> (8 * b));
    }
  } else if (dtype == "BF16" || dtype == "F16") {
    out.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t u =
          dtype == "BF16" ? detail::FloatToBf16(values[i]) : detail::FloatToFp16(values[i]);
      out[2 * i] = static_cast<char>(u & 0xFF);
      out[2 * i + 1] = static_cast<char>(u >> 8);
    }
  } else {
    out.assign(values.size() * std::max<size_t>(detail::DtypeBytes(dtype), 1), '\0');
  }
  return out;
}

absl::Status WriteRawSafetensors(const std::string& path, absl::string_view header,
                                 absl::string_view data) {
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  for (int b = 0; b < 8; ++b) bytes[b] = static_cast<char>(n >> (8 * b));
  absl::StrAppend(&bytes, header, data);
  return WriteFile(path, bytes);
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<RawTensor>& tensors) {
  std::vector<std::string> entries = {"\"__metadata__\":{\"format\":\"pt\"}"};
  std::string data;
  for (const RawTensor& t : tensors) {
    const size_t begin = data.size();
    data += t.bytes;
    entries.push_back(absl::StrCat(Quote(t.name), ":{\"dtype\":", Quote(t.dtype), ",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", begin, ",",
                                   data.size(), "]}"));
  }
  std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  while (header.size() % 8 != 0) header += ' ';
  return WriteRawSafetensors(path, header, data);
}

std::string WrittenCheckpoint::TensorName(int layer, TensorKind kind, int expert) const {
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const bool mixtral = family == Family::kMixtral;
  const std::string e =
      absl::StrCat(p, mixtral ? "block_sparse_moe." : "mlp.", "experts.", expert, ".");
  const bool deepseek = family == Family::kDeepseekV2 || family == Family::kDeepseekV3;
  const std::string shared =
      absl::StrCat(p, deepseek ? "mlp.shared_experts." : "mlp.shared_expert.");
  const bool has_shared = layer_config.shared_ffn_size > 0;
  switch (kind) {
    case TensorKind::kRouter:
      return absl::StrCat(p, mixtral ? "block_sparse_moe." : "mlp.", "gate.weight");
    case TensorKind::kRouterBias:
      return family == Family::kDeepseekV3 ? absl::StrCat(p, "mlp.gate.e_score_correction_bias")
                                           : "";
    case TensorKind::kExpertGate:
      return absl::StrCat(e, mixtral ? "w1.weight" : "gate_proj.weight");
    case TensorKind::kExpertUp:
      return absl::StrCat(e, mixtral ? "w3.weight" : "up_proj.weight");
    case TensorKind::kExpertDown:
      return absl::StrCat(e, mixtral ? "w2.weight" : "down_proj.weight");
    case TensorKind::kSharedGate:
      return has_shared ? absl::StrCat(shared, "gate_proj.weight") : "";
    case TensorKind::kSharedUp:
      return has_shared ? absl::StrCat(shared, "up_proj.weight") : "";
    case TensorKind::kSharedDown:
      return has_shared ? absl::StrCat(shared, "down_proj.weight") : "";
    case TensorKind::kSharedExpertGate:
      return family == Family::kQwen2Moe && has_shared
                 ? absl::StrCat(p, "mlp.shared_expert_gate.weight")
                 : "";
  }
  return "";
}

LayerWeights WrittenCheckpoint::Layer(int layer) const {
  LayerWeights w;
  auto get = [&](TensorKind kind, int expert) {
    const std::string name = TensorName(layer, kind, expert);
    auto it = values.find(name);
    return it == values.end() ? std::vector<float>{} : it->second;
  };
  w.router = get(TensorKind::kRouter, 0);
  w.router_bias = get(TensorKind::kRouterBias, 0);
  for (int e = 0; e < layer_config.num_experts; ++e) {
    w.gate.push_back(get(TensorKind::kExpertGate, e));
    w.up.push_back(get(TensorKind::kExpertUp, e));
    w.down.push_back(get(TensorKind::kExpertDown, e));
  }
  w.shared_gate = get(TensorKind::kSharedGate, 0);
  w.shared_up = get(TensorKind::kSharedUp, 0);
  w.shared_down = get(TensorKind::kSharedDown, 0);
  w.shared_expert_gate = get(TensorKind::kSharedExpertGate, 0);
  return w;
}

absl::StatusOr<WrittenCheckpoint> WriteCheckpoint(const CheckpointSpec& spec,
                                                  const std::string& folder) {
  if (!IsFloatDtype(spec.dtype))
    return absl::InvalidArgumentError("dtype must be F32, BF16 or F16");
  if (spec.num_shards < 1) return absl::InvalidArgumentError("num_shards must be >= 1");
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", folder, ": ", ec.message()));
  std::filesystem::remove(folder + "/model.safetensors", ec);
  std::filesystem::remove(folder + "/model.safetensors.index.json", ec);

  WrittenCheckpoint w;
  w.folder = folder;
  w.family = spec.family;
  const Family f = spec.family;
  const bool deepseek = f == Family::kDeepseekV2 || f == Family::kDeepseekV3;
  const bool qwen = f == Family::kQwen2Moe || f == Family::kQwen3Moe;
  const int64_t h = spec.hidden_size;
  const int64_t dense_ffn = 40;  // intermediate_size of the dense layers' MLP

  // The served layer as config.json describes it.
  MoeLayerConfig& c = w.layer_config;
  c.hidden_size = h;
  c.expert_ffn_size = spec.expert_ffn_size;
  c.num_experts = spec.num_experts;
  c.top_k = spec.top_k;
  c.norm_topk_prob = f == Family::kMixtral ? true : spec.norm_topk_prob;
  if (f == Family::kQwen2Moe) {
    c.shared_ffn_size = spec.shared_ffn_size;
    c.shared_expert_gate = spec.shared_ffn_size > 0;
  }
  if (deepseek) {
    c.shared_ffn_size = spec.n_shared_experts * spec.expert_ffn_size;
    c.norm_topk_prob = spec.norm_topk_prob && spec.top_k > 1;
    c.routed_scaling_factor = static_cast<float>(spec.routed_scaling_factor);
    if (f == Family::kDeepseekV2 && c.norm_topk_prob) c.routed_scaling_factor = 1.0f;
    if (f == Family::kDeepseekV3) {
      c.routing = RoutingKind::kSigmoidGroupedTopK;
      c.n_group = spec.n_group;
      c.topk_group = spec.topk_group;
    }
  }
  for (int l = 0; l < spec.num_layers; ++l) {
    const bool dense = (deepseek || qwen) && l < spec.dense_layers;
    (dense ? w.dense_layers : w.moe_layers).push_back(l);
  }

  // config.json, keys in the order Hugging Face writes them (roughly).
  std::vector<std::pair<std::string, std::string>> cfg;
  auto set = [&](const std::string& key, const std::string& value) {
    cfg.emplace_back(key, value);
  };
  const std::string arch = f == Family::kMixtral      ? "MixtralForCausalLM"
                           : f == Family::kQwen2Moe   ? "Qwen2MoeForCausalLM"
                           : f == Family::kQwen3Moe   ? "Qwen3MoeForCausalLM"
                           : f == Family::kDeepseekV2 ? "DeepseekV2ForCausalLM"
                           : f == Family::kDeepseekV3 ? "DeepseekV3ForCausalLM"
                                                      : "OlmoeForCausalLM";
  set("architectures", absl::StrCat("[", Quote(arch), "]"));
  set("model_type", Quote(FamilyName(f)));
  set("hidden_act", Quote("silu"));
  set("hidden_size", absl::StrCat(h));
  set("num_hidden_layers", absl::StrCat(spec.num_layers));
  set("num_attention_heads", "4");
  set("vocab_size", "16");
  set("rms_norm_eps", "1e-06");
  set("rope_theta", "1000000.0");
  set("tie_word_embeddings", "false");
  set("torch_dtype", Quote(spec.dtype == "F32"   ? "float32"
                           : spec.dtype == "F16" ? "float16"
                                                 : "bfloat16"));
  set("num_experts_per_tok", absl::StrCat(spec.top_k));
  switch (f) {
    case Family::kMixtral:
      set("num_local_experts", absl::StrCat(spec.num_experts));
      set("intermediate_size", absl::StrCat(spec.expert_ffn_size));
      set("router_jitter_noise", "0.0");
      break;
    case Family::kOlmoe:
      set("num_experts", absl::StrCat(spec.num_experts));
      set("intermediate_size", absl::StrCat(spec.expert_ffn_size));
      set("norm_topk_prob", spec.norm_topk_prob ? "true" : "false");
      break;
    case Family::kQwen2Moe:
    case Family::kQwen3Moe: {
      set("num_experts", absl::StrCat(spec.num_experts));
      set("moe_intermediate_size", absl::StrCat(spec.expert_ffn_size));
      set("intermediate_size", absl::StrCat(dense_ffn));
      if (f == Family::kQwen2Moe)
        set("shared_expert_intermediate_size", absl::StrCat(spec.shared_ffn_size));
      set("norm_topk_prob", spec.norm_topk_prob ? "true" : "false");
      set("decoder_sparse_step", "1");
      std::vector<int> mlp_only(w.dense_layers.begin(), w.dense_layers.end());
      set("mlp_only_layers", absl::StrCat("[", absl::StrJoin(mlp_only, ","), "]"));
      break;
    }
    case Family::kDeepseekV2:
    case Family::kDeepseekV3:
      set("n_routed_experts", absl::StrCat(spec.num_experts));
      set("n_shared_experts", absl::StrCat(spec.n_shared_experts));
      set("moe_intermediate_size", absl::StrCat(spec.expert_ffn_size));
      set("intermediate_size", absl::StrCat(dense_ffn));
      set("first_k_dense_replace", absl::StrCat(spec.dense_layers));
      set("moe_layer_freq", "1");
      set("n_group", absl::StrCat(spec.n_group));
      set("topk_group", absl::StrCat(spec.topk_group));
      set("norm_topk_prob", spec.norm_topk_prob ? "true" : "false");
      set("routed_scaling_factor", absl::StrCat(spec.routed_scaling_factor));
      set("scoring_func", Quote(f == Family::kDeepseekV3 ? "sigmoid" : "softmax"));
      set("topk_method", Quote(f == Family::kDeepseekV3 ? "noaux_tc" : "greedy"));
      set("q_lora_rank", "null");
      set("kv_lora_rank", "16");
      break;
  }
  for (const auto& [key, value] : spec.config_overrides) {
    auto it = std::find_if(cfg.begin(), cfg.end(), [&](const auto& kv) { return kv.first == key; });
    if (value.empty()) {
      if (it != cfg.end()) cfg.erase(it);
    } else if (it != cfg.end()) {
      it->second = value;
    } else {
      cfg.emplace_back(key, value);
    }
  }
  std::vector<std::string> lines;
  for (const auto& [key, value] : cfg) lines.push_back(absl::StrCat("  ", Quote(key), ": ", value));
  if (absl::Status s = WriteFile(folder + "/config.json",
                                 absl::StrCat("{\n", absl::StrJoin(lines, ",\n"), "\n}\n"));
      !s.ok())
    return s;

  // Every tensor: a few non-MoE ones (as real checkpoints have), then per layer.
  std::vector<Planned> plan;
  auto fan_in = [](int64_t cols) { return 1.0f / std::sqrt(static_cast<float>(cols)); };
  plan.push_back({"model.embed_tokens.weight", {16, h}, 1.0f});
  for (int l = 0; l < spec.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    plan.push_back({p + "input_layernorm.weight", {h}, 1.0f});
    plan.push_back({p + "self_attn.o_proj.weight", {h, h}, fan_in(h)});
    if (std::find(w.dense_layers.begin(), w.dense_layers.end(), l) != w.dense_layers.end()) {
      plan.push_back({p + "mlp.gate_proj.weight", {dense_ffn, h}, fan_in(h)});
      plan.push_back({p + "mlp.up_proj.weight", {dense_ffn, h}, fan_in(h)});
      plan.push_back({p + "mlp.down_proj.weight", {h, dense_ffn}, fan_in(dense_ffn)});
      continue;
    }
    auto add = [&](TensorKind kind, int expert) {
      const std::string name = w.TensorName(l, kind, expert);
      if (name.empty()) return;
      const TensorShape s = ShapeOf(c, kind);
      std::vector<int64_t> shape = {s.rows, s.cols};
      if (kind == TensorKind::kRouterBias) shape = {s.cols};
      plan.push_back({name, shape, kind == TensorKind::kRouterBias ? 0.1f : fan_in(s.cols)});
    };
    add(TensorKind::kRouter, 0);
    add(TensorKind::kRouterBias, 0);
    for (int e = 0; e < spec.num_experts; ++e) {
      add(TensorKind::kExpertGate, e);
      add(TensorKind::kExpertUp, e);
      add(TensorKind::kExpertDown, e);
    }
    add(TensorKind::kSharedGate, 0);
    add(TensorKind::kSharedUp, 0);
    add(TensorKind::kSharedDown, 0);
    add(TensorKind::kSharedExpertGate, 0);
  }

  // Tensors go to shards round-robin, so every layer spans several files.
  std::vector<std::vector<RawTensor>> shards(spec.num_shards);
  for (int s = 0; s < spec.num_shards; ++s) {
    w.files.push_back(spec.num_shards == 1
                          ? "model.safetensors"
                          : absl::StrCat("model-", absl::Dec(s + 1, absl::kZeroPad5), "-of-",
                                         absl::Dec(spec.num_shards, absl::kZeroPad5),
                                         ".safetensors"));
  }
  size_t next = 0;
  for (Planned& t : plan) {
    if (spec.omit_tensors.count(t.name)) continue;
    // DeepSeek-V3 stores its correction bias in F32 whatever the weights are.
    std::string dtype =
        t.name.find("e_score_correction_bias") != std::string::npos ? "F32" : spec.dtype;
    if (auto it = spec.tensor_dtypes.find(t.name); it != spec.tensor_dtypes.end())
      dtype = it->second;
    if (auto it = spec.tensor_shapes.find(t.name); it != spec.tensor_shapes.end())
      t.shape = it->second;
    std::vector<float> v = Values(spec.seed, t.name, Numel(t.shape), t.scale);
    RawTensor raw{t.name, dtype, t.shape, EncodeValues(v, dtype)};
    if (IsFloatDtype(dtype)) {
      for (float& x : v) x = RoundTrip(x, dtype);
      w.values[t.name] = std::move(v);
    }
    const size_t shard = next++ % shards.size();
    w.file_of[t.name] = w.files[shard];
    shards[shard].push_back(std::move(raw));
  }
  for (int s = 0; s < spec.num_shards; ++s) {
    if (absl::Status st = WriteSafetensors(folder + "/" + w.files[s], shards[s]); !st.ok())
      return st;
  }
  if (spec.num_shards > 1) {
    std::vector<std::string> entries;
    int64_t total = 0;
    for (const auto& shard : shards)
      for (const RawTensor& t : shard) {
        entries.push_back(absl::StrCat("    ", Quote(t.name), ": ", Quote(w.file_of[t.name])));
        total += static_cast<int64_t>(t.bytes.size());
      }
    const std::string index =
        absl::StrCat("{\n  \"metadata\": {\"total_size\": ", total, "},\n  \"weight_map\": {\n",
                     absl::StrJoin(entries, ",\n"), "\n  }\n}\n");
    if (absl::Status s = WriteFile(folder + "/model.safetensors.index.json", index); !s.ok())
      return s;
  }
  return w;
}

}  // namespace epserve::model::testing
