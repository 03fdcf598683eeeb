// Times the grouped expert FFN, the router and the combine on one OpenCL device (meant for
// GPUs) for model shapes, and prints one JSON object per case on stdout. The baseline
// (torch.matmul on the same GEMM shapes) runs in bench/gpu/run_gpu_bench.py, in the same run.
//
//   bench_ffn_gpu [--device=gpu] [--shapes=qwen1.5-moe-a2.7b,mixtral-8x7b]
//                 [--rows=128,512,2048,8192] [--experts=4] [--portable-rows=128]
//                 [--portable-shapes=qwen1.5-moe-a2.7b] [--min-seconds=1]
//
// For each shape, `experts` experts (fewer if the model has fewer) get `rows` rows each:
// FLOPs = experts * rows * 6 * H * F (gate, up and down projections, 2 per multiply-add).
//   {"shape":S,"path":"tensor_cores"|"portable","experts":E,"rows_per_expert":R,
//    "ms":X,"tflops":X,"reps":N}
// and for the token count T = experts * rows / top_k that routes to those rows:
//   {"shape":S,"tokens":T,"route_ms":X,"combine_ms":X}
// Each case runs after warm-up; the figure is the median of at least 5 timed runs, each
// ended by clFinish.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/bench_support.h"
#include "common/flags.h"
#include "common/status.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/synthetic.h"

namespace epserve::bench {
namespace {

using common::ElementType;
using kernels::Buffer;

// Median seconds of fn() (which ends with a device finish, returning its status) after two
// warm-up calls: at least 5 timed runs, more while under min_seconds, at most 200.
template <typename Fn>
absl::StatusOr<std::pair<double, int>> DeviceMedianSeconds(Fn&& fn, double min_seconds) {
  absl::Status failed;
  int reps = 0;
  const double median = MedianSeconds(
      [&] {
        if (absl::Status s = fn(); !s.ok() && failed.ok()) failed = s;
      },
      /*warmup=*/2, /*min_reps=*/5, /*max_reps=*/200, min_seconds, &reps);
  if (!failed.ok()) return failed;
  return std::make_pair(median, reps);
}

absl::Status BenchShape(const std::string& shape, const std::vector<int64_t>& rows_list,
                        std::vector<int64_t> portable_rows, int max_experts, double min_seconds,
                        kernels::Runtime& rt, kernels::Runtime& portable_rt) {
  EPSERVE_ASSIGN_OR_RETURN(model::ModelConfig config, model::SyntheticPreset(shape));
  const model::SyntheticWeights source(config, 0);
  const model::MoeLayerConfig& cfg = config.layer;
  const int layer = config.moe_layers.front();
  const int experts = std::min(max_experts, cfg.num_experts);
  const int64_t h = cfg.hidden_size, f = cfg.expert_ffn_size;
  const int64_t max_rows = experts * *std::max_element(rows_list.begin(), rows_list.end());
  std::fprintf(stderr, "%s: uploading %d experts (H=%lld F=%lld)\n", shape.c_str(), experts,
               static_cast<long long>(h), static_cast<long long>(f));
  EPSERVE_ASSIGN_OR_RETURN(
      kernels::ExpertWeights w,
      kernels::UploadExperts(rt, source, layer, 0, experts, ElementType::kBf16));
  EPSERVE_ASSIGN_OR_RETURN(kernels::RouterWeights router, kernels::UploadRouter(rt, source, layer));

  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x_host(max_rows * h);
  for (float& v : x_host) v = uniform(rng);
  EPSERVE_ASSIGN_OR_RETURN(Buffer x, rt.AllocateCopy(x_host.data(), x_host.size() * sizeof(float)));
  std::vector<int32_t> index(max_rows);
  for (int64_t p = 0; p < max_rows; ++p) index[p] = static_cast<int32_t>(p);
  EPSERVE_ASSIGN_OR_RETURN(Buffer row_index,
                           rt.AllocateCopy(index.data(), index.size() * sizeof(int32_t)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer hs, rt.Allocate(max_rows * f * sizeof(float)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer y, rt.Allocate(max_rows * h * sizeof(float)));
  const int k = cfg.top_k;
  EPSERVE_ASSIGN_OR_RETURN(Buffer ids, rt.Allocate(max_rows * k * sizeof(int32_t)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer weights, rt.Allocate(max_rows * k * sizeof(float)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer out, rt.Allocate(max_rows * h * sizeof(float)));

  auto run_ffn = [&](kernels::Runtime& r, const kernels::ExpertWeights& ew, const Buffer& xb,
                     const Buffer& ib, Buffer& hb, Buffer& yb, int64_t rows,
                     const char* path) -> absl::Status {
    std::vector<int64_t> offsets(experts + 1);
    for (int e = 0; e <= experts; ++e) offsets[e] = e * rows;
    auto fn = [&]() -> absl::Status {
      EPSERVE_RETURN_IF_ERROR(kernels::ExpertFfn(r, ew, xb, ib, offsets, hb, yb));
      return r.Finish();
    };
    EPSERVE_ASSIGN_OR_RETURN(auto timing, DeviceMedianSeconds(fn, min_seconds));
    const double flops = static_cast<double>(experts) * rows * 6.0 * h * f;
    std::printf(
        "{\"shape\":\"%s\",\"path\":\"%s\",\"experts\":%d,\"rows_per_expert\":%lld,"
        "\"ms\":%.4f,\"tflops\":%.2f,\"reps\":%d}\n",
        shape.c_str(), path, experts, static_cast<long long>(rows), timing.first * 1e3,
        flops / timing.first / 1e12, timing.second);
    std::fflush(stdout);
    return absl::OkStatus();
  };

  if (w.tensor_cores) {  // builds the program, so that the cache report below covers it
    EPSERVE_RETURN_IF_ERROR(rt.Kernel("ffn_mma_gate_up").status());
  }
  std::fprintf(stderr, "program cache: %d built, %d loaded; %s\n", rt.cache_stats().built,
               rt.cache_stats().loaded, rt.cache_stats().last_error.c_str());
  for (int64_t rows : rows_list) {
    EPSERVE_RETURN_IF_ERROR(
        run_ffn(rt, w, x, row_index, hs, y, rows, w.tensor_cores ? "tensor_cores" : "portable"));
    // Router and combine for the tokens whose top-k choices make these rows.
    const int64_t tokens = std::max<int64_t>(1, experts * rows / k);
    std::vector<int32_t> pair_index(tokens * k);
    std::vector<float> pair_weight(tokens * k, 1.0f / k);
    for (int64_t i = 0; i < tokens * k; ++i) pair_index[i] = static_cast<int32_t>(i);
    EPSERVE_ASSIGN_OR_RETURN(
        Buffer pib, rt.AllocateCopy(pair_index.data(), pair_index.size() * sizeof(int32_t)));
    EPSERVE_ASSIGN_OR_RETURN(
        Buffer pwb, rt.AllocateCopy(pair_weight.data(), pair_weight.size() * sizeof(float)));
    EPSERVE_ASSIGN_OR_RETURN(auto route, DeviceMedianSeconds(
                                             [&]() -> absl::Status {
                                               EPSERVE_RETURN_IF_ERROR(kernels::Route(
                                                   rt, router, x, tokens, ids, weights));
                                               return rt.Finish();
                                             },
                                             min_seconds / 4));
    EPSERVE_ASSIGN_OR_RETURN(auto combine, DeviceMedianSeconds(
                                               [&]() -> absl::Status {
                                                 EPSERVE_RETURN_IF_ERROR(kernels::WeightedCombine(
                                                     rt, y, pib, pwb, tokens, k, h, out));
                                                 return rt.Finish();
                                               },
                                               min_seconds / 4));
    std::printf("{\"shape\":\"%s\",\"tokens\":%lld,\"route_ms\":%.4f,\"combine_ms\":%.4f}\n",
                shape.c_str(), static_cast<long long>(tokens), route.first * 1e3,
                combine.first * 1e3);
    std::fflush(stdout);
  }
  if (!w.tensor_cores || portable_rows.empty()) return absl::OkStatus();
  // The portable kernels on the same device, for comparison.
  EPSERVE_ASSIGN_OR_RETURN(
      kernels::ExpertWeights pw,
      kernels::UploadExperts(portable_rt, source, layer, 0, experts, ElementType::kBf16));
  const int64_t pmax = experts * *std::max_element(portable_rows.begin(), portable_rows.end());
  EPSERVE_ASSIGN_OR_RETURN(
      Buffer px,
      portable_rt.AllocateCopy(x_host.data(), std::min(pmax, max_rows) * h * sizeof(float)));
  std::vector<int32_t> pindex(pmax);
  for (int64_t p = 0; p < pmax; ++p) pindex[p] = static_cast<int32_t>(p % max_rows);
  EPSERVE_ASSIGN_OR_RETURN(
      Buffer pib, portable_rt.AllocateCopy(pindex.data(), pindex.size() * sizeof(int32_t)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer phs, portable_rt.Allocate(pmax * f * sizeof(float)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer py, portable_rt.Allocate(pmax * h * sizeof(float)));
  for (int64_t rows : portable_rows) {
    EPSERVE_RETURN_IF_ERROR(run_ffn(portable_rt, pw, px, pib, phs, py, rows, "portable"));
  }
  return absl::OkStatus();
}

int Run(int argc, char** argv) {
  std::string shapes = "qwen1.5-moe-a2.7b,mixtral-8x7b";
  std::vector<int64_t> rows = {128, 512, 2048, 8192};
  std::vector<int64_t> portable = {128};
  std::string portable_shapes = "qwen1.5-moe-a2.7b";
  int64_t max_experts = 4;
  double min_seconds = 1.0;
  kernels::RuntimeOptions rto;
  rto.device = "gpu";
  common::FlagSet fs("bench_ffn_gpu", "Expert FFN, router and combine timings on one device.");
  fs.Add("device", &rto.device, "OpenCL device: gpu, cpu or <platform>:<device>");
  fs.Add("shapes", &shapes, "Comma list of synthetic presets");
  fs.Add("rows", &rows, "Comma list of rows per expert");
  fs.Add("portable-rows", &portable,
         "Rows per expert also timed on the portable kernels (where tensor cores run the rest)");
  fs.Add("portable-shapes", &portable_shapes, "Shapes the portable comparison runs for");
  fs.Add("experts", &max_experts, "Experts per case (at most the model's)");
  fs.Add("min-seconds", &min_seconds, "Time each case at least this long");
  const int code = ParseFlags(
      fs, argc, argv,
      [&] {
        return max_experts >= 1 && AllPositive(rows) && AllPositive(portable, /*empty_ok=*/true);
      },
      "--experts and every --rows and --portable-rows entry must be >= 1");
  if (code >= 0) return code;
  absl::StatusOr<std::unique_ptr<kernels::Runtime>> rt = kernels::Runtime::Create(rto);
  kernels::RuntimeOptions portable_options = rto;
  portable_options.tensor_cores = false;
  absl::StatusOr<std::unique_ptr<kernels::Runtime>> prt =
      kernels::Runtime::Create(portable_options);
  if (!rt.ok() || !prt.ok()) {
    std::fprintf(stderr, "%s\n", std::string((!rt.ok() ? rt : prt).status().message()).c_str());
    return 1;
  }
  std::printf("{\"device\":\"%s\",\"tensor_cores\":%s,\"wgmma\":%s}\n",
              (*rt)->device_info().Describe().c_str(), (*rt)->tensor_cores() ? "true" : "false",
              (*rt)->wgmma() ? "true" : "false");
  std::fflush(stdout);
  const std::vector<absl::string_view> pshapes =
      absl::StrSplit(portable_shapes, ',', absl::SkipWhitespace());
  for (absl::string_view shape : absl::StrSplit(shapes, ',', absl::SkipWhitespace())) {
    const bool with_portable = std::find(pshapes.begin(), pshapes.end(), shape) != pshapes.end();
    absl::Status s =
        BenchShape(std::string(shape), rows, with_portable ? portable : std::vector<int64_t>{},
                   static_cast<int>(max_experts), min_seconds, **rt, **prt);
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", std::string(shape).c_str(), s.ToString().c_str());
      return 1;
    }
  }
  // Whether the 128-row tiles did run on wgmma (false if the sm_90a program did not build).
  std::printf("{\"wgmma_ran\":%s}\n", (*rt)->wgmma() ? "true" : "false");
  return 0;
}

}  // namespace
}  // namespace epserve::bench

int main(int argc, char** argv) { return epserve::bench::Run(argc, argv); }
