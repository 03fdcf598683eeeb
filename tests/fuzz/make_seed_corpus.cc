// Writes the seed corpus of the fuzz targets into the folder given (tests/fuzz/corpus):
// valid and nearly valid requests, safetensors files and config.json files.
//   build/tests/fuzz/make_seed_corpus tests/fuzz/corpus
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "grpc_service.pb.h"
#include "tests/model/checkpoint_writer.h"

namespace {

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

inference::ModelInferRequest Request(int64_t tokens, const char* datatype, int element_bytes) {
  inference::ModelInferRequest r;
  r.set_model_name("moe");
  r.set_id("seed");
  auto* in = r.add_inputs();
  in->set_name("hidden_states");
  in->set_datatype(datatype);
  in->add_shape(tokens);
  in->add_shape(8);
  r.add_raw_input_contents(std::string(tokens * 8 * element_bytes, '\x3f'));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path root = argc > 1 ? argv[1] : "corpus";
  int n = 0;
  auto request = [&](const inference::ModelInferRequest& r) {
    Write(root / "infer_request" / ("seed-" + std::to_string(n++)), r.SerializeAsString());
  };
  request(Request(1, "FP32", 4));
  request(Request(3, "BF16", 2));
  request(Request(2, "FP16", 2));
  inference::ModelInferRequest typed = Request(2, "FP32", 4);
  typed.clear_raw_input_contents();
  for (int i = 0; i < 16; ++i) typed.mutable_inputs(0)->mutable_contents()->add_fp32_contents(i);
  request(typed);
  inference::ModelInferRequest params = Request(1, "FP32", 4);
  (*params.mutable_parameters())["layer"].set_int64_param(3);
  (*params.mutable_parameters())["priority"].set_uint64_param(1);
  (*params.mutable_parameters())["timeout"].set_int64_param(1000);
  params.add_outputs()->set_name("moe_output");
  params.add_outputs()->set_name("topk_ids");
  (*params.mutable_outputs(0)->mutable_parameters())["datatype"].set_string_param("BF16");
  request(params);
  request(Request(0, "FP32", 4));
  request(Request(70, "FP32", 4));

  // Checkpoints of three families: their shards seed the safetensors target, their
  // config.json files the config target.
  using epserve::model::testing::Family;
  int c = 0;
  for (Family family : {Family::kMixtral, Family::kQwen2Moe, Family::kDeepseekV3}) {
    epserve::model::testing::CheckpointSpec spec;
    spec.family = family;
    spec.hidden_size = 8;
    spec.expert_ffn_size = 4;
    spec.num_experts = 4;
    spec.num_layers = 1;
    spec.dtype = c == 0 ? "F32" : c == 1 ? "BF16" : "F16";
    if (family == Family::kDeepseekV3) {
      spec.n_group = 2;
      spec.topk_group = 1;
    }
    const std::filesystem::path tmp = std::filesystem::temp_directory_path() / "epserve-seed-ckpt";
    std::filesystem::remove_all(tmp);
    auto written = epserve::model::testing::WriteCheckpoint(spec, tmp.string());
    if (!written.ok()) return 1;
    Write(root / "model_config" / ("seed-" + std::to_string(c)), ReadFile(tmp / "config.json"));
    Write(root / "safetensors" / ("seed-" + std::to_string(c)),
          ReadFile(tmp / written->files.front()));
    std::filesystem::remove_all(tmp);
    ++c;
  }
  return 0;
}
