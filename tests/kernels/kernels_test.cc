// Every kernel against model/'s reference, with fresh random inputs each run (the seed is
// printed on failure) and outputs poisoned with NaN before each run so unwritten rows fail.
//
// BF16 weights or activations are checked twice: against the reference run on the same
// BF16-rounded values (round to nearest even, as the upload does) at the FP32 bound 1e-5,
// which only FP32 accumulation error passes and which a wrong rounding mode fails; and
// against the reference on the original FP32 values at the BF16 bound 1e-2. The tensor-core
// FFN (BF16 weights on NVIDIA GPUs) and the BF16 dot-product FFN (BF16 weights on x86 CPUs
// with AVX512-BF16) also round x and h to BF16: their first check runs a reference that rounds
// them the same way, at kMaxRelErrorMma.
//
// The tests run on the device EPSERVE_TEST_DEVICE names ("cpu" when unset; "gpu" or
// "<platform>:<device>"), so that the same checks hold on every OpenCL device.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/detail/device.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "model/weights.h"
#include "tests/common/seeded.h"
#include "tests/kernels/kernel_fixture.h"

namespace epserve::kernels {
namespace {

using common::ElementType;

constexpr double kMaxRelErrorFp32 = 1e-5;
constexpr double kMaxRelErrorBf16 = 1e-2;
// Tensor-core and dot-product FFN against a reference that rounds x and h to BF16 as they do: the
// kernel's FP32 h can still round to the neighbouring BF16 value where the double one sits within
// FP32 error of a rounding midpoint, one BF16 ulp (2^-8 relative) on a few h values.
// Each flip moves y by about 2^-8 / sqrt(F) of its scale; 4e-3 allows several in one row
// while a wrong layout or operand order is off by O(1).
constexpr double kMaxRelErrorMma = 4e-3;
// Tokens whose routing decision is closer than this to flipping are not checked for ids.
constexpr double kMarginWithinRounding = 1e-5;

// max |a - ref| / max(max |ref|, tiny): the error relative to the scale of the result.
double RelError(const std::vector<float>& a, const std::vector<double>& ref) {
  double diff = 0.0;
  double scale = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - ref[i]);
    diff = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(diff, d);
    scale = std::max(scale, std::abs(ref[i]));
  }
  return diff / std::max(scale, 1e-30);
}

// The options of the device the tests run on (EPSERVE_TEST_DEVICE, default "cpu").
// A synthetic preset, or "tiny-odd": tiny with H = 72 and 10 experts, top-3 (shapes that are
// not multiples of the kernels' vectors and blocks).
model::SyntheticWeights Preset(const std::string& name, uint64_t seed) {
  if (name == "tiny-odd") {
    absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
    EXPECT_TRUE(cfg.ok()) << cfg.status();
    cfg->layer.hidden_size = 72;
    cfg->layer.num_experts = 10;
    cfg->layer.top_k = 3;
    return model::SyntheticWeights(*cfg, seed);
  }
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset(name);
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  return model::SyntheticWeights(*cfg, seed);
}

// "tiny" with H = hidden, F = ffn and `experts` experts.
model::SyntheticWeights TinyShaped(int64_t hidden, int64_t ffn, int experts, uint64_t seed) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  cfg->layer.hidden_size = hidden;
  cfg->layer.expert_ffn_size = ffn;
  cfg->layer.num_experts = experts;
  return model::SyntheticWeights(*cfg, seed);
}

std::string PresetTestName(const ::testing::TestParamInfo<std::string>& param_info) {
  std::string name = param_info.param;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// ---- runtime ----

TEST(RuntimeTest, ListsDevicesAndCreatesOnCpu) {
  absl::StatusOr<std::vector<DeviceInfo>> devices = ListDevices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  ASSERT_FALSE(devices->empty());
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(RuntimeOptions{});
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_TRUE((*rt)->device_info().is_cpu);
  RuntimeOptions by_index;
  by_index.device =
      absl::StrCat((*rt)->device_info().platform_index, ":", (*rt)->device_info().device_index);
  absl::StatusOr<std::unique_ptr<Runtime>> rt2 = Runtime::Create(by_index);
  ASSERT_TRUE(rt2.ok()) << rt2.status();
  EXPECT_EQ((*rt2)->device_info().device_name, (*rt)->device_info().device_name);
}

// The width the blocking follows is the build target's, not only what the driver reports:
// PoCL told to build for Haswell on an AVX-512 host still reports 16 lanes (ctest
// kernels_haswell_target_test runs this file so; EPSERVE_EXPECT_TARGET_ISA names the target).
TEST(RuntimeTest, CpuWidthFollowsTheBuildTarget) {
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(TestRuntimeOptions());
  ASSERT_TRUE(rt.ok()) << rt.status();
  const DeviceInfo& info = (*rt)->device_info();
  if (!info.is_cpu) GTEST_SKIP() << "not a CPU device: " << info.Describe();
#if defined(__x86_64__)
  EXPECT_FALSE(info.target_isa.empty()) << "the probe kernel did not run on " << info.Describe();
#endif
  // PoCL compiles with its own clang; the same probe reads its version (which decides whether
  // the dot kernels' builtin form is tried at all).
  if (detail::IsPoclCpu(info)) {
    EXPECT_GE(info.clang_major, 9) << info.Describe();
  }
  if (const char* want = std::getenv("EPSERVE_EXPECT_TARGET_ISA"); want != nullptr) {
    EXPECT_EQ(info.target_isa, want);
  }
  if (!info.target_isa.empty() && info.target_isa != "avx512f") {
    EXPECT_LE(info.native_float_width, 8);
    EXPECT_FALSE((*rt)->bf16_dot()) << "BF16 dot products need an AVX-512 build target";
    for (const FfnBlocking& b : FfnBlockingCandidates(info)) EXPECT_EQ(b.vec, 8) << b.ToString();
  }
}

TEST(RuntimeTest, UnmatchedDeviceListsDevicesFound) {
  absl::StatusOr<std::vector<DeviceInfo>> devices = ListDevices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  const bool has_gpu =
      std::any_of(devices->begin(), devices->end(), [](const DeviceInfo& d) { return d.is_gpu; });
  std::vector<std::pair<std::string, absl::StatusCode>> cases = {
      {"99:0", absl::StatusCode::kNotFound},
      {"0:99", absl::StatusCode::kNotFound},
      {"fpga", absl::StatusCode::kInvalidArgument},
      {"1:x", absl::StatusCode::kInvalidArgument}};
  if (!has_gpu) cases.emplace_back("gpu", absl::StatusCode::kNotFound);
  for (const auto& [spec, code] : cases) {
    RuntimeOptions options;
    options.device = spec;
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_FALSE(rt.ok()) << spec;
    EXPECT_EQ(rt.status().code(), code) << rt.status();
    EXPECT_NE(rt.status().message().find(absl::StrCat("'", spec, "'")), std::string::npos)
        << rt.status();
    for (const DeviceInfo& d : *devices) {
      EXPECT_NE(rt.status().message().find(d.Describe()), std::string::npos) << rt.status();
    }
  }
}

TEST(RuntimeTest, BrokenKernelSurfacesBuildLog) {
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(TestRuntimeOptions());
  ASSERT_TRUE(rt.ok()) << rt.status();
  absl::Status s = (*rt)->BuildProgramForTest(
      "__kernel void broken(__global float* x) { x[0] = undeclared_symbol_q7; }\n");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("CL_BUILD_PROGRAM_FAILURE"), std::string::npos) << s;
  EXPECT_NE(s.message().find("undeclared_symbol_q7"), std::string::npos) << s;  // from the log
  EXPECT_TRUE(
      (*rt)->BuildProgramForTest("__kernel void fine(__global float* x) { x[0] = 1; }").ok());
}

// One weighted combine through `r`'s combine program, the output poisoned before:
// out = 2 * y[1] + 0.5 * y[0].
void ExpectCombineRuns(Runtime& r) {
  const std::vector<float> y = {1, 2, 3, 4, 5, 6};
  const std::vector<int32_t> index = {1, 0};
  const std::vector<float> weight = {2.0f, 0.5f};
  const std::vector<float> poison(3, std::numeric_limits<float>::quiet_NaN());
  absl::StatusOr<Buffer> yb = r.AllocateCopy(y.data(), y.size() * sizeof(float));
  absl::StatusOr<Buffer> ib = r.AllocateCopy(index.data(), index.size() * sizeof(int32_t));
  absl::StatusOr<Buffer> wb = r.AllocateCopy(weight.data(), weight.size() * sizeof(float));
  absl::StatusOr<Buffer> out = r.AllocateCopy(poison.data(), poison.size() * sizeof(float));
  ASSERT_TRUE(yb.ok() && ib.ok() && wb.ok() && out.ok());
  ASSERT_TRUE(WeightedCombine(r, *yb, *ib, *wb, 1, 2, 3, *out).ok());
  std::vector<float> got(3);
  ASSERT_TRUE(r.Read(*out, 0, got.data(), 3 * sizeof(float)).ok());
  EXPECT_EQ(got, (std::vector<float>{2 * 4 + 0.5f * 1, 2 * 5 + 0.5f * 2, 2 * 6 + 0.5f * 3}));
}

TEST(RuntimeTest, ProgramCacheIsWrittenThenReused) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("epserve-kernel-cache-test-", std::random_device{}());
  std::filesystem::remove_all(dir);
  RuntimeOptions options = TestRuntimeOptions();
  options.cache_dir = dir.string();
  options.program_binaries = RuntimeOptions::ProgramBinaries::kAlways;  // PoCL's too
  {
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    EXPECT_TRUE((*rt)->stores_program_binaries());
    ASSERT_TRUE((*rt)->Kernel("weighted_combine").ok());
    EXPECT_EQ((*rt)->cache_stats().loaded, 0);
    EXPECT_GE((*rt)->cache_stats().built, 1);
    EXPECT_EQ((*rt)->cache_stats().stored, (*rt)->cache_stats().built)
        << (*rt)->cache_stats().last_error;
  }
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().extension(), ".bin") << entry.path();  // no temporaries left
    EXPECT_GT(entry.file_size(), 0u);
    ++files;
  }
  EXPECT_GE(files, 1);
  {
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    Runtime& r = **rt;
    absl::StatusOr<cl_kernel> kernel = r.Kernel("weighted_combine");
    ASSERT_TRUE(kernel.ok()) << kernel.status();
    EXPECT_GE(r.cache_stats().loaded, 1);
    EXPECT_EQ(r.cache_stats().built, 0) << r.cache_stats().last_error;
    ExpectCombineRuns(r);  // the cached program
  }
  std::filesystem::remove_all(dir);
}

// By default PoCL's programs leave no binary in the cache (its own cache keeps what a warm
// start reads; kernels/runtime.h ProgramBinaries), every other driver's do; kOff stores none.
TEST(RuntimeTest, ProgramBinariesStoredButPoclsByDefault) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("epserve-kernel-binaries-test-", std::random_device{}());
  for (const auto mode :
       {RuntimeOptions::ProgramBinaries::kAuto, RuntimeOptions::ProgramBinaries::kOff}) {
    std::filesystem::remove_all(dir);
    RuntimeOptions options = TestRuntimeOptions();
    options.cache_dir = dir.string();
    options.program_binaries = mode;
    bool pocl = false;
    int programs = 0;
    for (int start = 0; start < 2; ++start) {
      absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
      ASSERT_TRUE(rt.ok()) << rt.status();
      Runtime& r = **rt;
      pocl = detail::IsPoclCpu(r.device_info());
      const bool stores = mode == RuntimeOptions::ProgramBinaries::kAuto && !pocl;
      EXPECT_EQ(r.stores_program_binaries(), stores) << r.device_info().Describe();
      ASSERT_TRUE(r.Kernel("weighted_combine").ok());
      // The programs built on the way to the kernel (those before it in the runtime's list).
      const ProgramCacheStats& stats = r.cache_stats();
      if (start == 0) programs = stats.built;
      EXPECT_GE(programs, 1);
      if (stores) {
        EXPECT_EQ(stats.built, start == 0 ? programs : 0) << stats.last_error;
        EXPECT_EQ(stats.loaded, start == 0 ? 0 : programs);
        EXPECT_EQ(stats.stored, stats.built);
      } else {
        EXPECT_EQ(stats.built, programs);  // from source both times
        EXPECT_EQ(stats.loaded, 0);
        EXPECT_EQ(stats.stored, 0);
      }
      ExpectCombineRuns(r);  // whatever the cache holds
    }
    int binaries = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      binaries += entry.path().extension() == ".bin";
    }
    EXPECT_EQ(binaries, mode == RuntimeOptions::ProgramBinaries::kAuto && !pocl ? programs : 0);
  }
  std::filesystem::remove_all(dir);
}

using RuntimeSourceTest = Seeded;

TEST_F(RuntimeSourceTest, FolderReplacesEmbeddedSources) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("epserve-kernel-sources-test-", std::random_device{}());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  RuntimeOptions options = TestRuntimeOptions();
  options.source_dir = dir.string();
  options.cache_dir = (dir / "cache").string();
  {
    // A folder without the sources: the error names the file it wanted.
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    absl::StatusOr<cl_kernel> kernel = (*rt)->Kernel("weighted_combine");
    ASSERT_FALSE(kernel.ok());
    EXPECT_EQ(kernel.status().code(), absl::StatusCode::kNotFound);
    EXPECT_NE(kernel.status().message().find((dir / "router.cl").string()), std::string::npos)
        << kernel.status();
  }
  // Sources of the same kernel names that compute something else: the folder's copy runs.
  const float marker = Uniform(1, 1.0f, 2.0f)[0];
  for (const char* name : {"router", "expert_ffn", "expert_ffn_mma"}) {
    std::ofstream(dir / absl::StrCat(name, ".cl"))
        << "__kernel void unused_" << name << "(__global int* p) { p[0] = 0; }\n";
  }
  std::ofstream(dir / "combine.cl")
      << "__kernel void weighted_combine(__global const float* y, long y_rows,\n"
         "    __global const int* pair_index, __global const float* pair_weight, int n, int k,\n"
         "    long hidden, __global float* out) {\n"
         "  const size_t c = get_global_id(0);\n"
         "  const int i = get_global_id(1);\n"
         "  if (c < (size_t)hidden && i < n) out[i * hidden + c] = "
      << absl::StrFormat("%.9gf", marker) << ";\n}\n";
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;
  const std::vector<float> y = Uniform(6);
  const std::vector<int32_t> index = {1, 0};
  const std::vector<float> weight = {2.0f, 0.5f};
  absl::StatusOr<Buffer> yb = r.AllocateCopy(y.data(), y.size() * sizeof(float));
  absl::StatusOr<Buffer> ib = r.AllocateCopy(index.data(), index.size() * sizeof(int32_t));
  absl::StatusOr<Buffer> wb = r.AllocateCopy(weight.data(), weight.size() * sizeof(float));
  std::vector<float> got(3, std::numeric_limits<float>::quiet_NaN());
  absl::StatusOr<Buffer> out = r.AllocateCopy(got.data(), got.size() * sizeof(float));
  ASSERT_TRUE(yb.ok() && ib.ok() && wb.ok() && out.ok());
  ASSERT_TRUE(WeightedCombine(r, *yb, *ib, *wb, 1, 2, 3, *out).ok());
  ASSERT_TRUE(r.Read(*out, 0, got.data(), got.size() * sizeof(float)).ok());
  EXPECT_EQ(got, std::vector<float>(3, marker));
  std::filesystem::remove_all(dir);
}

// ---- element types ----

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  auto bits = [](uint32_t b) { return std::bit_cast<float>(b); };
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(bits(0x3F807FFF)), 0x3F80);  // below half: down
  EXPECT_EQ(FloatToBf16(bits(0x3F808000)), 0x3F80);  // half, even below: down
  EXPECT_EQ(FloatToBf16(bits(0x3F808001)), 0x3F81);  // above half: up
  EXPECT_EQ(FloatToBf16(bits(0x3F818000)), 0x3F82);  // half, even above: up
  EXPECT_EQ(FloatToBf16(bits(0xBF818000)), 0xBF82);  // the same for negatives
  EXPECT_EQ(FloatToBf16(bits(0x00008000)), 0x0000);  // subnormals too
  EXPECT_EQ(FloatToBf16(bits(0x00018000)), 0x0002);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to infinity
  EXPECT_EQ(FloatToBf16(bits(0x7F7F7FFF)), 0x7F7F);                   // largest that does not
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(bits(0x7F800001)))));  // payload in low bits
  EXPECT_EQ(Bf16ToFloat(0x4049), bits(0x40490000));
  EXPECT_EQ(RoundToBf16(3.14159265f), bits(0x40490000));
}

TEST(DTypeTest, ParsesNames) {
  auto parse = [](absl::string_view name) {
    return common::ParseFlagName(name, "--weight-dtype", kKernelTypes);
  };
  EXPECT_EQ(*parse("fp32"), ElementType::kFp32);
  EXPECT_EQ(*parse("bf16"), ElementType::kBf16);
  absl::StatusOr<ElementType> bad = parse("fp16");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "--weight-dtype must be fp32 or bf16, got 'fp16'");
  EXPECT_EQ(common::FlagName(ElementType::kBf16), "bf16");
  EXPECT_TRUE(CheckKernelType(ElementType::kBf16, "w").ok());
  EXPECT_EQ(CheckKernelType(ElementType::kFp8E4m3, "w").code(), absl::StatusCode::kInvalidArgument);
}

// ---- route ----

class RouteTest : public Seeded, public ::testing::WithParamInterface<std::string> {};

TEST_P(RouteTest, MatchesReference) {
  // The device's forms, then the work-group forms of GPUs (on any device).
  for (Runtime* forms : {static_cast<Runtime*>(nullptr), &WorkGroupFormsRt()}) {
    rt_ = forms;
    SCOPED_TRACE(forms == nullptr ? "the device's forms" : "the work-group forms");
    const model::SyntheticWeights source = Preset(GetParam(), seed_);
    const model::MoeLayerConfig& cfg = source.config().layer;
    absl::StatusOr<model::LayerWeights> host = model::LoadLayer(source, 0);
    ASSERT_TRUE(host.ok()) << host.status();
    absl::StatusOr<RouterWeights> w = UploadRouter(R(), source, 0);
    ASSERT_TRUE(w.ok()) << w.status();
    const int k = cfg.top_k;
    int skipped = 0;
    int checked = 0;
    for (int64_t n : {1, 7, 33, 300}) {
      SCOPED_TRACE(absl::StrCat("n=", n));
      // Wide inputs so that softmax/sigmoid scores spread and ties are rare.
      const std::vector<float> x = Uniform(n * cfg.hidden_size, -3.0f, 3.0f);
      const model::Routing ref = model::ReferenceRoute(cfg, *host, x.data(), n);
      Buffer xb = Upload(x);
      Buffer ids = Poisoned(n * k);
      Buffer weights = Poisoned(n * k);
      ASSERT_TRUE(Route(R(), *w, xb, n, ids, weights).ok());
      const std::vector<int32_t> got_ids = Download<int32_t>(ids, n * k);
      const std::vector<float> got_w = Download<float>(weights, n * k);
      // A second run gives the same bits.
      Buffer weights2 = Poisoned(n * k);
      ASSERT_TRUE(Route(R(), *w, xb, n, ids, weights2).ok());
      EXPECT_EQ(Download<int32_t>(ids, n * k), got_ids);
      const std::vector<float> got_w2 = Download<float>(weights2, n * k);
      EXPECT_EQ(std::memcmp(got_w.data(), got_w2.data(), n * k * sizeof(float)), 0);
      for (int64_t t = 0; t < n; ++t) {
        if (ref.margins[t] < kMarginWithinRounding) {
          ++skipped;
          continue;
        }
        ++checked;
        std::vector<double> ref_w(k);
        std::vector<float> tok_w(k);
        for (int j = 0; j < k; ++j) {
          EXPECT_EQ(got_ids[t * k + j], ref.ids[t * k + j]) << "token " << t << " choice " << j;
          ref_w[j] = ref.weights[t * k + j];
          tok_w[j] = got_w[t * k + j];
        }
        EXPECT_LE(RelError(tok_w, ref_w), kMaxRelErrorFp32) << "token " << t;
      }
    }
    std::cout << "[ route " << GetParam() << " ] checked " << checked << " tokens, skipped "
              << skipped << " within rounding of a tie\n";
    EXPECT_LT(skipped, checked / 20 + 1) << "too many near-ties to be a meaningful check";
  }
  rt_ = nullptr;
}

INSTANTIATE_TEST_SUITE_P(Presets, RouteTest,
                         ::testing::Values("tiny", "tiny-grouped", "tiny-group-limited",
                                           "tiny-topk-softmax", "tiny-odd"),
                         PresetTestName);

// ---- expert FFN ----

// Random expert-major layout of `pairs` rows over `num_experts` experts with some empty:
// expert 1 (when it exists) and the last expert get no rows.
std::vector<int64_t> RandomOffsets(std::mt19937_64& rng, int num_experts, int64_t pairs) {
  std::vector<int> eligible;
  for (int e = 0; e < num_experts; ++e) {
    if (num_experts < 3 || (e != 1 && e != num_experts - 1)) eligible.push_back(e);
  }
  std::vector<int64_t> counts(num_experts, 0);
  std::uniform_int_distribution<size_t> pick(0, eligible.size() - 1);
  for (int64_t p = 0; p < pairs; ++p) ++counts[eligible[pick(rng)]];
  std::vector<int64_t> offsets(num_experts + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  return offsets;
}

// Reference outputs y[p] = FFN_e(x[row_index[p]]) in double.
std::vector<double> ReferenceFfn(const std::vector<std::vector<float>>& gate,
                                 const std::vector<std::vector<float>>& up,
                                 const std::vector<std::vector<float>>& down, int64_t hidden,
                                 int64_t ffn, const std::vector<float>& x,
                                 const std::vector<int32_t>& row_index,
                                 const std::vector<int64_t>& offsets) {
  std::vector<double> y(offsets.back() * hidden, 0.0);
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    for (int64_t p = offsets[e]; p < offsets[e + 1]; ++p) {
      model::ReferenceExpert(gate[e].data(), up[e].data(), down[e].data(), hidden, ffn,
                             x.data() + row_index[p] * hidden, y.data() + p * hidden, 1.0);
    }
  }
  return y;
}

// The tensor-core FFN's arithmetic in double: x (already BF16 values) and weights as given,
// h rounded to BF16 before the down projection.
std::vector<double> ReferenceFfnBf16H(const std::vector<std::vector<float>>& gate,
                                      const std::vector<std::vector<float>>& up,
                                      const std::vector<std::vector<float>>& down, int64_t hidden,
                                      int64_t ffn, const std::vector<float>& x,
                                      const std::vector<int32_t>& row_index,
                                      const std::vector<int64_t>& offsets) {
  std::vector<double> y(offsets.back() * hidden, 0.0);
  std::vector<double> hv(ffn);
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    for (int64_t p = offsets[e]; p < offsets[e + 1]; ++p) {
      const float* xr = x.data() + row_index[p] * hidden;
      for (int64_t j = 0; j < ffn; ++j) {
        double g = 0.0, u = 0.0;
        for (int64_t c = 0; c < hidden; ++c) {
          g += static_cast<double>(gate[e][j * hidden + c]) * xr[c];
          u += static_cast<double>(up[e][j * hidden + c]) * xr[c];
        }
        hv[j] = RoundToBf16(static_cast<float>(g / (1.0 + std::exp(-g)) * u));
      }
      for (int64_t c = 0; c < hidden; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j < ffn; ++j) acc += static_cast<double>(down[e][c * ffn + j]) * hv[j];
        y[p * hidden + c] = acc;
      }
    }
  }
  return y;
}

std::vector<float> RoundedToBf16(std::vector<float> v) {
  for (float& f : v) f = RoundToBf16(f);
  return v;
}

// Rows of `x` [rows, hidden] as FP32 rows `stride` values apart, the padding NaN.
std::vector<float> PaddedRows(const std::vector<float>& x, int64_t hidden, int64_t stride) {
  const int64_t rows = static_cast<int64_t>(x.size()) / hidden;
  std::vector<float> out(rows * stride, std::numeric_limits<float>::quiet_NaN());
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.begin() + r * hidden, hidden, out.begin() + r * stride);
  }
  return out;
}

// Rows of `x` [rows, hidden] as BF16 rows `stride` values apart, the padding NaN.
std::vector<uint16_t> Bf16Rows(const std::vector<float>& x, int64_t hidden, int64_t stride) {
  const int64_t rows = static_cast<int64_t>(x.size()) / hidden;
  std::vector<uint16_t> out(rows * stride, 0x7FC0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < hidden; ++c) out[r * stride + c] = FloatToBf16(x[r * hidden + c]);
  }
  return out;
}

// Element types of one FFN run, and the padding after each row of x (in values).
struct FfnTypes {
  ElementType weights = ElementType::kFp32;
  ElementType x = ElementType::kFp32;
  int64_t x_pad = 0;
};

std::string Describe(FfnTypes t) {
  return absl::StrCat("weights ", common::FlagName(t.weights), ", x ", common::FlagName(t.x),
                      " padded by ", t.x_pad);
}

class ExpertFfnTest : public Seeded {
 protected:
  // Runs ExpertFfn over experts [first, first + count) of `source` for `pairs` rows drawn
  // from `tokens` token rows and checks it against the reference (see the top of the file
  // for BF16). Rows of x are types.x_pad NaNs apart. Returns y.
  std::vector<float> Check(const model::WeightSource& source, int first, int count, int64_t tokens,
                           int64_t pairs, FfnTypes types = {},
                           std::span<const int64_t> fixed_offsets = {}) {
    const model::MoeLayerConfig& cfg = source.config().layer;
    const int64_t h = cfg.hidden_size;
    const int64_t f = cfg.expert_ffn_size;
    std::vector<std::vector<float>> gate(count), up(count), down(count);
    for (int e = 0; e < count; ++e) {
      gate[e].resize(f * h);
      up[e].resize(f * h);
      down[e].resize(h * f);
      EXPECT_TRUE(source.Fill(0, model::TensorKind::kExpertGate, first + e, gate[e].data()).ok());
      EXPECT_TRUE(source.Fill(0, model::TensorKind::kExpertUp, first + e, up[e].data()).ok());
      EXPECT_TRUE(source.Fill(0, model::TensorKind::kExpertDown, first + e, down[e].data()).ok());
    }
    absl::StatusOr<ExpertWeights> w = UploadExperts(R(), source, 0, first, count, types.weights);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return {};
    EXPECT_EQ(w->dtype, types.weights);
    // BF16 weights take the tensor-core kernels wherever the runtime has them.
    EXPECT_EQ(w->tensor_cores, types.weights == ElementType::kBf16 && R().tensor_cores() &&
                                   detail::MmaFitsCallerBuffers(h, f));
    // Elsewhere the runtime's choice for the shape: the BF16 dot products (only for BF16
    // weights on a runtime that has them), or the portable kernels with the chosen blocking.
    if (!w->tensor_cores) {
      absl::StatusOr<FfnPlan> chosen = R().ChooseFfnPlan(h, f, types.weights);
      EXPECT_TRUE(chosen.ok()) << chosen.status();
      if (chosen.ok()) {
        EXPECT_EQ(w->bf16_dot, chosen->layout().dot);
        EXPECT_EQ(w->plan, *chosen);
        EXPECT_EQ(w->blocking, chosen->layout());
      }
    }
    EXPECT_TRUE(!w->bf16_dot || (types.weights == ElementType::kBf16 && R().bf16_dot()));
    const std::vector<float> x = Uniform(tokens * h);
    const std::vector<int64_t> offsets =
        fixed_offsets.empty() ? RandomOffsets(rng_, count, pairs)
                              : std::vector<int64_t>(fixed_offsets.begin(), fixed_offsets.end());
    EXPECT_EQ(offsets.back(), pairs);
    std::vector<int32_t> row_index(pairs);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(tokens - 1));
    for (int32_t& r : row_index) r = token(rng_);
    const RowFormat x_format{types.x, h + types.x_pad};
    const Buffer xb = types.x == ElementType::kBf16 ? Upload(Bf16Rows(x, h, x_format.row_stride))
                                                    : Upload(PaddedRows(x, h, x_format.row_stride));
    Buffer ib = Upload(row_index);
    Buffer hb = Poisoned(pairs * f);
    Buffer yb = Poisoned(pairs * h);
    absl::Status s = ExpertFfn(R(), *w, xb, ib, offsets, hb, yb, x_format);
    EXPECT_TRUE(s.ok()) << s;
    const std::vector<float> y = Download<float>(yb, pairs * h);
    const std::string what =
        absl::StrCat("H=", h, " F=", f, " experts=", count, " pairs=", pairs, " ", Describe(types));
    if (types.weights == ElementType::kFp32 && types.x == ElementType::kFp32) {
      EXPECT_LE(RelError(y, ReferenceFfn(gate, up, down, h, f, x, row_index, offsets)),
                kMaxRelErrorFp32)
          << what;
      return y;
    }
    // The same values the device holds: FP32 accumulation error only.
    auto stored = [&](ElementType t, std::vector<float> v) {
      return t == ElementType::kBf16 ? RoundedToBf16(std::move(v)) : v;
    };
    std::vector<std::vector<float>> gate_s(count), up_s(count), down_s(count);
    for (int e = 0; e < count; ++e) {
      gate_s[e] = stored(types.weights, gate[e]);
      up_s[e] = stored(types.weights, up[e]);
      down_s[e] = stored(types.weights, down[e]);
    }
    if (w->tensor_cores || w->bf16_dot) {
      EXPECT_LE(RelError(y, ReferenceFfnBf16H(gate_s, up_s, down_s, h, f, RoundedToBf16(x),
                                              row_index, offsets)),
                kMaxRelErrorMma)
          << what << (w->tensor_cores ? " (tensor cores)" : " (BF16 dot products)")
          << " against the reference on BF16 x, weights and h";
    } else {
      EXPECT_LE(RelError(y, ReferenceFfn(gate_s, up_s, down_s, h, f, stored(types.x, x), row_index,
                                         offsets)),
                kMaxRelErrorFp32)
          << what << " against the reference on the BF16-rounded values";
    }
    EXPECT_LE(RelError(y, ReferenceFfn(gate, up, down, h, f, x, row_index, offsets)),
              kMaxRelErrorBf16)
        << what << " against the FP32 reference";
    return y;
  }

  // The tensor-core tiles' shape (K pads to 224, down rows to 256, F to 192) on `rt`
  // (nullptr: the shared runtime), `types` against the reference.
  void CheckTensorCoreTiles(Runtime* rt, std::span<const FfnTypes> types) {
    rt_ = rt;
    CheckShape(/*hidden=*/200, /*ffn=*/136, /*experts=*/5, /*tokens=*/300, types, {1, 129, 700});
    rt_ = nullptr;
  }
  // Check over every expert of a "tiny" layer reshaped to H = hidden, F = ffn and `experts`
  // experts, for each of `types` and each row count of `pairs_list`, rows drawn from `tokens`
  // token rows.
  void CheckShape(int64_t hidden, int64_t ffn, int experts, int64_t tokens,
                  std::span<const FfnTypes> types, std::initializer_list<int64_t> pairs_list) {
    const model::SyntheticWeights source = TinyShaped(hidden, ffn, experts, seed_);
    for (const FfnTypes& t : types) {
      for (int64_t pairs : pairs_list) {
        SCOPED_TRACE(absl::StrCat("pairs=", pairs, " ", Describe(t)));
        Check(source, 0, experts, tokens, pairs, t);
      }
    }
  }
};

const FfnTypes kAllTypes[] = {{ElementType::kFp32, ElementType::kFp32, 0},
                              {ElementType::kBf16, ElementType::kFp32, 5},
                              {ElementType::kFp32, ElementType::kBf16, 8},
                              {ElementType::kBf16, ElementType::kBf16, 0}};

TEST_F(ExpertFfnTest, TinyPresetsAllExperts) {
  for (const char* preset : {"tiny", "tiny-grouped", "tiny-topk-softmax"}) {
    const model::SyntheticWeights source = Preset(preset, seed_);
    for (int64_t pairs : {1, 7, 33, 300}) {
      SCOPED_TRACE(absl::StrCat(preset, " pairs=", pairs));
      Check(source, 0, source.config().layer.num_experts, /*tokens=*/pairs + 3, pairs);
    }
  }
}

TEST_F(ExpertFfnTest, Bf16WeightsAndActivations) {
  for (const FfnTypes types : std::span(kAllTypes).subspan(1)) {
    for (const char* preset : {"tiny", "tiny-grouped"}) {
      const model::SyntheticWeights source = Preset(preset, seed_);
      for (int64_t pairs : {1, 7, 33, 300}) {
        SCOPED_TRACE(absl::StrCat(preset, " pairs=", pairs, " ", Describe(types)));
        Check(source, 0, source.config().layer.num_experts, /*tokens=*/pairs + 3, pairs, types);
      }
    }
  }
}

TEST_F(ExpertFfnTest, Bf16WeightsTakeHalfTheBytes) {
  const model::SyntheticWeights source = Preset("tiny", seed_);
  absl::StatusOr<ExpertWeights> fp32 = UploadExperts(Rt(), source, 0, 0, 3);
  absl::StatusOr<ExpertWeights> bf16 = UploadExperts(Rt(), source, 0, 0, 3, ElementType::kBf16);
  ASSERT_TRUE(fp32.ok() && bf16.ok());
  EXPECT_EQ(bf16->dtype, ElementType::kBf16);
  if (bf16->tensor_cores) {
    // Tiled BF16 with K padded to the tile (H = 64, F = 32 here).
    const int64_t h = 64, f = 32;
    EXPECT_EQ(bf16->gate_up.bytes(), 3 * 2 * detail::MmaGateUpValuesPerExpert(h, f));
    EXPECT_EQ(bf16->down.bytes(), 3 * 2 * detail::MmaDownValuesPerExpert(h, f));
  } else if (bf16->bf16_dot) {
    // Pair panels: K even here, so exactly half of FP32.
    const int64_t h = 64, f = 32;
    EXPECT_EQ(bf16->gate_up.bytes(), 3 * 2 * detail::GateUpDotValuesPerExpert(h, f));
    EXPECT_EQ(bf16->down.bytes(), 3 * 2 * detail::DownDotValuesPerExpert(h, f));
    EXPECT_EQ(2 * bf16->gate_up.bytes(), fp32->gate_up.bytes());
    EXPECT_EQ(2 * bf16->down.bytes(), fp32->down.bytes());
  } else {
    EXPECT_EQ(2 * bf16->gate_up.bytes(), fp32->gate_up.bytes());
    EXPECT_EQ(2 * bf16->down.bytes(), fp32->down.bytes());
  }
}

// The tiled tensor-core weight layout places every (n, k) of a padded matrix exactly once, a
// whole K slice of a tile in one contiguous run, and each 8 values of a row in one chunk.
TEST(MmaLayoutTest, TiledOffsetIsABijectionWithContiguousSlices) {
  for (const auto& [n_pad, k_pad] : {std::pair<int64_t, int64_t>{detail::kMmaBn, detail::kMmaBk},
                                     {2 * detail::kMmaBn, 3 * detail::kMmaBk}}) {
    std::vector<int> seen(n_pad * k_pad, 0);
    const int64_t slice = detail::kMmaBn * detail::kMmaBk;
    for (int64_t n = 0; n < n_pad; ++n) {
      for (int64_t k = 0; k < k_pad; ++k) {
        const int64_t at = detail::MmaTiledOffset(n, k, k_pad);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, n_pad * k_pad);
        ++seen[at];
        const int64_t tile = (n / detail::kMmaBn) * (k_pad / detail::kMmaBk) + k / detail::kMmaBk;
        EXPECT_EQ(at / slice, tile) << n << "," << k;
        EXPECT_EQ(at % 8, k % 8) << n << "," << k;
      }
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n_pad * k_pad);
  }
}

// Shapes that pad every dimension of the tensor-core tiles, rows that span several tiles of
// one expert. Runs on every device (the portable kernels where there are no tensor cores).
TEST_F(ExpertFfnTest, TensorCoreTilesAndPadding) {
  const FfnTypes types[] = {{ElementType::kBf16, ElementType::kFp32, 3},
                            {ElementType::kBf16, ElementType::kBf16, 6}};
  CheckTensorCoreTiles(nullptr, types);
}

// The same with the 128-row tiles on mma.sync where they would take wgmma (sm_90; elsewhere
// both runs take the same kernels): each form against the reference.
TEST_F(ExpertFfnTest, TensorCoreTilesWithoutWgmma) {
  RuntimeOptions options = TestRuntimeOptions();
  options.wgmma = RuntimeOptions::Wgmma::kOff;
  std::unique_ptr<Runtime> rt = CreateTestRuntime(options, false);
  ASSERT_NE(rt, nullptr);
  EXPECT_FALSE(rt->wgmma());
  const FfnTypes types[] = {{ElementType::kBf16, ElementType::kFp32, 3}};
  CheckTensorCoreTiles(rt.get(), types);
}

// The same with each expert's short last tile after its full ones in the 128-row kernels (as
// for experts larger than the device's cache).
TEST_F(ExpertFfnTest, TensorCoreShortTilesWithTheFullOnes) {
  RuntimeOptions options = TestRuntimeOptions();
  options.short_tiles_with_full = true;
  std::unique_ptr<Runtime> rt = CreateTestRuntime(options, false);
  ASSERT_NE(rt, nullptr);
  const FfnTypes types[] = {{ElementType::kBf16, ElementType::kFp32, 3}};
  CheckTensorCoreTiles(rt.get(), types);
}

// Experts whose last tile holds each class of rows the 128-row kernels treat apart: up to 32
// (one copy a work-item of A), up to 64 (half the tile multiplied on wgmma), up to 96 and
// more, alone or after full tiles, with the short tiles in their own forms and after the full
// ones. The rows beyond a tile's group are never copied: a wrong row would show here.
TEST_F(ExpertFfnTest, TensorCoreShortTilesOfEveryRowClass) {
  const model::SyntheticWeights source = TinyShaped(/*hidden=*/200, /*ffn=*/136, 7, seed_);
  // Pairs per expert: 33, 64, 70, 128 + 17, 256 + 50, 128 + 100, 20.
  const int64_t offsets[] = {0, 33, 97, 167, 312, 618, 846, 866};
  const FfnTypes types = {ElementType::kBf16, ElementType::kFp32, 3};
  for (const bool with_full : {false, true}) {
    for (const auto wgmma : {RuntimeOptions::Wgmma::kAuto, RuntimeOptions::Wgmma::kOff}) {
      SCOPED_TRACE(absl::StrCat(with_full ? "short tiles after the full ones" : "short tiles apart",
                                wgmma == RuntimeOptions::Wgmma::kOff ? ", no wgmma" : ""));
      RuntimeOptions options = TestRuntimeOptions();
      options.short_tiles_with_full = with_full;
      options.wgmma = wgmma;
      std::unique_ptr<Runtime> rt = CreateTestRuntime(options, false);
      ASSERT_NE(rt, nullptr);
      rt_ = rt.get();
      Check(source, 0, 7, /*tokens=*/300, offsets[7], types, offsets);
      rt_ = nullptr;
    }
  }
}

// Odd H and F: the pair-panel layout pads K to even (a zero weight, a zero activation), and
// h's padding column must come out zero. Runs on every device.
TEST_F(ExpertFfnTest, OddShapesPadThePairs) {
  CheckShape(/*hidden=*/71, /*ffn=*/37, /*experts=*/4, /*tokens=*/60, kAllTypes, {1, 13, 250});
}

// The pair-panel layout places every (column, k) of a panel exactly once, and a k pair's two
// values of one column side by side.
TEST(DotLayoutTest, PanelOffsetIsABijectionWithAdjacentPairs) {
  const int64_t k_pad = 6;
  const int64_t values = detail::DotKPairs(k_pad) * 2 * detail::kDotPanelCols;
  std::vector<int> seen(values, 0);
  for (int64_t c = 0; c < detail::kDotPanelCols; ++c) {
    for (int64_t k = 0; k < k_pad; ++k) {
      const int64_t o = detail::DotPanelOffset(c, k);
      ASSERT_GE(o, 0);
      ASSERT_LT(o, values);
      ++seen[o];
      if (k % 2 == 0) {
        EXPECT_EQ(detail::DotPanelOffset(c, k + 1), o + 1);
      }
      // One k pair's 32 values of 16 columns make one 64-byte vector.
      EXPECT_EQ(o / 32, (k / 2) * 2 + c / 16);
    }
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
}

TEST_F(ExpertFfnTest, SubsetOfExperts) {
  const model::SyntheticWeights source = Preset("tiny-grouped", seed_);
  Check(source, 5, 6, 40, 97);
}

TEST_F(ExpertFfnTest, ShapeNotAMultipleOfTheTiles) {
  CheckShape(/*hidden=*/72, /*ffn=*/40, /*experts=*/5, /*tokens=*/50, kAllTypes, {1, 7, 33, 300});
}

// Every blocking any device's tuner may pick, not only the one this device picks, against
// the reference: odd shapes, remainders of every register block, tiles over several chunks.
TEST_F(ExpertFfnTest, EveryBlockingCandidate) {
  for (const FfnBlocking& b : AllFfnBlockingCandidates()) {
    SCOPED_TRACE(b.ToString());
    RuntimeOptions options = TestRuntimeOptions();
    options.ffn_blocking = b.ToString();
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    rt_ = rt->get();
    const std::string& isa = R().device_info().target_isa;
    if (b.vec == 16 && !isa.empty() && isa != "avx512f") {
      // Such a device refuses the choice with the reason instead of failing to build it.
      absl::StatusOr<FfnPlan> refused = R().ChooseFfnPlan(72, 40, ElementType::kFp32);
      ASSERT_FALSE(refused.ok());
      EXPECT_NE(refused.status().message().find("vec=16 needs 16-lane"), std::string::npos)
          << refused.status();
      rt_ = nullptr;
      continue;
    }
    CheckShape(/*hidden=*/71, /*ffn=*/37, /*experts=*/4, /*tokens=*/60, kAllTypes, {1, 13, 250});
    CheckShape(/*hidden=*/72, /*ffn=*/40, /*experts=*/3, /*tokens=*/50, kAllTypes,
               {2, 5, 2 * b.row_chunk + 7});
    // (71, 37) and (72, 40) with FP32 weights, and with BF16 ones where they take the portable
    // kernels (not the tensor cores; a forced blocking keeps them off the dot products).
    const size_t portable_bf16 = Rt().tensor_cores() ? 0 : 2;
    EXPECT_EQ(rt_->ffn_choices().size(), 2 + portable_bf16);
    for (const FfnChoice& c : rt_->ffn_choices()) {
      EXPECT_EQ(c.origin, FfnBlockingOrigin::kForced);
      EXPECT_EQ(c.plan, FfnPlan::Uniform(b));
    }
    rt_ = nullptr;
  }
}

// Every form the tuner may pick for a row class (each FMA blocking of any device, each
// pair-panel form this runtime runs) on every row class it may serve, against the reference:
// the form forced for all four classes (a direct form staged above kDotDirectRows rows), the
// experts' rows at both ends of each class (and an empty expert), fresh random inputs and
// poisoned outputs each run (Check). ExpertFfnAs refuses a form of another layout or a
// direct form above its rows.
TEST_F(ExpertFfnTest, EveryFormOnEveryRowClass) {
  std::vector<FfnBlocking> forms = AllFfnBlockingCandidates();
  const bool dot = Rt().bf16_dot();
  if (dot) {
    for (const FfnBlocking& b : DotForms(Rt().bf16_amx())) forms.push_back(b);
  }
  // Rows of the three experts of each class's case (offsets are their running sums).
  constexpr int64_t kRows[kFfnRowClasses][3] = {{1, 0, 1}, {2, 8, 5}, {9, 64, 0}, {65, 130, 1}};
  const FfnTypes bf16_types[] = {{ElementType::kBf16, ElementType::kFp32, 5},
                                 {ElementType::kBf16, ElementType::kBf16, 0}};
  for (const FfnBlocking& b : forms) {
    SCOPED_TRACE(b.ToString());
    std::string plan;
    for (int c = 0; c < kFfnRowClasses; ++c) {
      FfnBlocking f = b;
      if (!FfnFormServes(f, c)) f.direct = false;
      absl::StrAppend(&plan, c == 0 ? "" : "; ", FfnRowClassName(c), ": ", f.ToString());
    }
    RuntimeOptions options = TestRuntimeOptions();
    options.ffn_blocking = plan;
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    rt_ = rt->get();
    const std::string& isa = R().device_info().target_isa;
    if ((!b.dot && b.vec == 16 && !isa.empty() && isa != "avx512f") || R().tensor_cores()) {
      rt_ = nullptr;  // refused with the reason (EveryBlockingCandidate), or not these kernels
      continue;
    }
    const model::SyntheticWeights source = TinyShaped(/*hidden=*/71, /*ffn=*/37, 3, seed_);
    for (int c = 0; c < kFfnRowClasses; ++c) {
      const std::vector<int64_t> offsets = {0, kRows[c][0], kRows[c][0] + kRows[c][1],
                                            kRows[c][0] + kRows[c][1] + kRows[c][2]};
      for (const FfnTypes& t :
           b.dot ? std::span<const FfnTypes>(bf16_types) : std::span<const FfnTypes>(kAllTypes)) {
        SCOPED_TRACE(absl::StrCat("rows class ", FfnRowClassName(c), " ", Describe(t)));
        Check(source, 0, 3, /*tokens=*/40, offsets.back(), t, offsets);
        absl::StatusOr<FfnPlan> chosen = R().ChooseFfnPlan(71, 37, t.weights);
        ASSERT_TRUE(chosen.ok()) << chosen.status();
        if (t.weights == ElementType::kBf16 || !b.dot) {
          EXPECT_EQ(chosen->forms[c].dot_op, b.dot_op);
          EXPECT_EQ(chosen->forms[c].ToString().substr(0, 3), b.ToString().substr(0, 3));
        }
      }
    }
    rt_ = nullptr;
  }
}

TEST_F(ExpertFfnTest, ExpertFfnAsRefusesAFormItCannotRun) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
  ASSERT_TRUE(cfg.ok());
  const model::SyntheticWeights source(*cfg, seed_);
  const model::MoeLayerConfig& l = cfg->layer;
  absl::StatusOr<ExpertWeights> w = UploadExperts(Rt(), source, 0, 0, 2, ElementType::kBf16);
  ASSERT_TRUE(w.ok()) << w.status();
  if (w->tensor_cores) GTEST_SKIP() << "tensor-core weights take no forms";
  const std::vector<int64_t> offsets = {0, 9, 9};
  Buffer x = Upload(Uniform(9 * l.hidden_size));
  Buffer index = Upload(std::vector<int32_t>(9, 0));
  Buffer h = Poisoned(9 * l.expert_ffn_size);
  Buffer y = Poisoned(9 * l.hidden_size);
  // Another layout's form.
  const FfnBlocking other = w->bf16_dot ? FfnBlocking() : DotKernels();
  absl::Status s = ExpertFfnAs(Rt(), *w, other, x, index, offsets, h, y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  if (w->bf16_dot) {
    s = ExpertFfnAs(Rt(), *w, DotKernels(FfnBlocking::DotOp::kDefault, true), x, index, offsets, h,
                    y);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("at most 8 rows"), std::string::npos) << s;
  }
}

TEST(FfnBlockingTest, ParsesAndRejectsWithTheBound) {
  absl::StatusOr<FfnBlocking> b = ParseFfnBlocking("vec=8,rows=6 prefetch=0");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->vec, 8);
  EXPECT_EQ(b->rows, 6);
  EXPECT_EQ(b->prefetch_steps, 0);
  EXPECT_EQ(b->row_chunk, FfnBlocking().row_chunk);
  absl::StatusOr<FfnBlocking> again = ParseFfnBlocking(b->ToString());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *b);
  absl::StatusOr<FfnBlocking> dot = ParseFfnBlocking(" dot ");
  ASSERT_TRUE(dot.ok()) << dot.status();
  EXPECT_TRUE(dot->dot);
  EXPECT_EQ(dot->ToString(), "dot");
  EXPECT_EQ(*dot, DotKernels());
  EXPECT_FALSE(*dot == FfnBlocking());
  for (const char* bad :
       {"vec=12", "rows=17", "rows=x", "chunk=4 rows=8", "colour=3", "dot rows=4"}) {
    absl::StatusOr<FfnBlocking> r = ParseFfnBlocking(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ParseFfnBlocking("rows=17").status().message().find("[2, 16]"), std::string::npos);
}

TEST(FfnBlockingTest, PlansPerRowClass) {
  EXPECT_EQ(FfnRowClass(1), 0);
  EXPECT_EQ(FfnRowClass(2), 1);
  EXPECT_EQ(FfnRowClass(8), 1);
  EXPECT_EQ(FfnRowClass(9), 2);
  EXPECT_EQ(FfnRowClass(64), 2);
  EXPECT_EQ(FfnRowClass(65), 3);
  EXPECT_EQ(FfnRowClass(100000), 3);
  for (int c = 0; c < kFfnRowClasses; ++c) {
    EXPECT_EQ(FfnRowClass(FfnRowClassFirst(c)), c);
    EXPECT_EQ(FfnRowClass(FfnRowClassSample(c)), c);
  }
  for (const FfnBlocking& b : DotForms(/*amx=*/true)) {
    absl::StatusOr<FfnBlocking> again = ParseFfnBlocking(b.ToString());
    ASSERT_TRUE(again.ok()) << b.ToString() << ": " << again.status();
    EXPECT_EQ(*again, b);
  }
  EXPECT_EQ(DotForms(/*amx=*/false).size(), 4u);  // "dot" is vdpbf16ps there
  const std::string text = "1: pair-fma-direct; 2-8: dot-direct; 9-64: dot; 65+: dot";
  absl::StatusOr<FfnPlan> plan = ParseFfnPlan(text);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ToString(), text);
  EXPECT_EQ(plan->For(1), DotKernels(FfnBlocking::DotOp::kFma, true));
  EXPECT_EQ(plan->For(200), DotKernels());
  // One form: the same for every class (a dot form direct up to 8 rows).
  absl::StatusOr<FfnPlan> uniform = ParseFfnPlan("dot");
  ASSERT_TRUE(uniform.ok());
  EXPECT_EQ(uniform->ToString(), "dot");
  EXPECT_EQ(uniform->For(8), DotKernels(FfnBlocking::DotOp::kDefault, true));
  EXPECT_EQ(uniform->For(9), DotKernels());
  for (const char* bad : {"1: dot; 2-8: dot; 9-64: dot",                   // 65+ missing
                          "1: dot; 2-8: dot; 9-64: dot-direct; 65+: dot",  // direct at 9+
                          "1: dot; 2-8: vec=16; 9-64: dot; 65+: dot",      // two layouts
                          "1: dot; 2-9: dot; 9-64: dot; 65+: dot"}) {      // no such class
    EXPECT_EQ(ParseFfnPlan(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(FfnBlockingTest, CandidatesFitTheDevicesRegisters) {
  DeviceInfo avx2;
  avx2.is_cpu = true;
  avx2.native_float_width = 8;
  DeviceInfo avx512 = avx2;
  avx512.native_float_width = 16;
  for (const FfnBlocking& b : FfnBlockingCandidates(avx2)) {
    // rows x 2 sums + 2 panel vectors + 1 broadcast, in 8-lane registers: at most 16.
    EXPECT_LE(b.rows * 2 * (b.vec / 8) + 2 * (b.vec / 8) + 1, 16) << b.ToString();
  }
  for (const FfnBlocking& b : FfnBlockingCandidates(avx512)) {
    EXPECT_LE(b.rows * 2 * (b.vec / 16) + 2 + 1, 32) << b.ToString();
  }
  EXPECT_EQ(FfnBlockingCandidates(avx512).front(), FfnBlocking());
}

// Cold start: the tuner times the candidates and stores the winner; warm start: the same
// choice from the cache with no timing; a forced choice and tune_ffn=false take no timing.
TEST(FfnBlockingTest, TunedOnceThenReadFromTheCache) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    absl::StrCat("epserve-ffn-tune-test-", std::random_device{}());
  std::filesystem::remove_all(dir);
  RuntimeOptions options = TestRuntimeOptions();
  options.cache_dir = dir.string();
  absl::StatusOr<std::unique_ptr<Runtime>> cold = Runtime::Create(options);
  ASSERT_TRUE(cold.ok()) << cold.status();
  if (FfnBlockingCandidates((*cold)->device_info()).size() < 2) {
    GTEST_SKIP() << "the device has one candidate: nothing to tune";
  }
  absl::StatusOr<FfnPlan> first = (*cold)->ChooseFfnPlan(2048, 768, ElementType::kFp32);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ((*cold)->ffn_choices().size(), 1u);
  EXPECT_EQ((*cold)->ffn_choices()[0].origin, FfnBlockingOrigin::kTuned);
  // The same shape again on the same runtime: no second choice.
  ASSERT_TRUE((*cold)->ChooseFfnPlan(2048, 768, ElementType::kFp32).ok());
  EXPECT_EQ((*cold)->ffn_choices().size(), 1u);
  int txt = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    txt += entry.path().extension() == ".txt";
  }
  EXPECT_EQ(txt, 1);

  absl::StatusOr<std::unique_ptr<Runtime>> warm = Runtime::Create(options);
  ASSERT_TRUE(warm.ok()) << warm.status();
  absl::StatusOr<FfnPlan> second = (*warm)->ChooseFfnPlan(2048, 768, ElementType::kFp32);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, *first);
  EXPECT_EQ((*warm)->ffn_choices()[0].origin, FfnBlockingOrigin::kCache);
  // Another dtype is another shape class: tuned on its own.
  absl::StatusOr<FfnPlan> bf16 = (*warm)->ChooseFfnPlan(2048, 768, ElementType::kBf16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  // Each class's form serves it, and the plan's forms share one layout.
  for (int c = 0; c < kFfnRowClasses; ++c) {
    EXPECT_TRUE(FfnFormServes(bf16->forms[c], c)) << bf16->ToString();
    EXPECT_TRUE(SameFfnLayout(bf16->forms[c], bf16->layout())) << bf16->ToString();
  }
  EXPECT_EQ((*warm)->ffn_choices()[1].origin, FfnBlockingOrigin::kTuned);
  if ((*warm)->bf16_dot()) {
    // The pair-panel forms were timed beside the FMA candidates (the entry lists them).
    int with_dot = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() != ".txt") continue;
      std::ifstream in(entry.path());
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      with_dot += text.find("\n# dot:") != std::string::npos &&
                  text.find("\n# pair-fma-direct:") != std::string::npos;
    }
    EXPECT_EQ(with_dot, 1);
  }

  RuntimeOptions no_tune = options;
  no_tune.tune_ffn = false;
  no_tune.cache_dir = (dir / "other").string();
  absl::StatusOr<std::unique_ptr<Runtime>> plain = Runtime::Create(no_tune);
  ASSERT_TRUE(plain.ok());
  absl::StatusOr<FfnPlan> d = (*plain)->ChooseFfnPlan(2048, 768, ElementType::kFp32);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, FfnPlan::Uniform((*plain)->default_ffn_blocking()));
  EXPECT_EQ((*plain)->ffn_choices()[0].origin, FfnBlockingOrigin::kDefault);

  RuntimeOptions forced = no_tune;
  forced.ffn_blocking = "vec=8 rows=5 chunk=10";
  absl::StatusOr<std::unique_ptr<Runtime>> f = Runtime::Create(forced);
  ASSERT_TRUE(f.ok());
  absl::StatusOr<FfnPlan> fb = (*f)->ChooseFfnPlan(2048, 768, ElementType::kFp32);
  ASSERT_TRUE(fb.ok());
  EXPECT_EQ(fb->layout().rows, 5);
  EXPECT_EQ((*f)->ffn_choices()[0].origin, FfnBlockingOrigin::kForced);
  // "dot" names BF16 weights' kernels: FP32 weights keep the default; BF16 ones take the dot
  // kernels where the runtime has them, and are refused with the reason elsewhere.
  forced.ffn_blocking = "dot";
  absl::StatusOr<std::unique_ptr<Runtime>> fd = Runtime::Create(forced);
  ASSERT_TRUE(fd.ok());
  absl::StatusOr<FfnPlan> fd32 = (*fd)->ChooseFfnPlan(2048, 768, ElementType::kFp32);
  ASSERT_TRUE(fd32.ok()) << fd32.status();
  EXPECT_EQ(*fd32, FfnPlan::Uniform((*fd)->default_ffn_blocking()));
  absl::StatusOr<FfnPlan> fd16 = (*fd)->ChooseFfnPlan(2048, 768, ElementType::kBf16);
  if ((*fd)->bf16_dot()) {
    ASSERT_TRUE(fd16.ok()) << fd16.status();
    EXPECT_EQ(*fd16, FfnPlan::Uniform(DotKernels()));
    EXPECT_TRUE(fd16->forms[0].direct);
    EXPECT_FALSE(fd16->forms[3].direct);
  } else {
    EXPECT_EQ(fd16.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(fd16.status().message().find("no BF16 dot-product kernels"), std::string::npos)
        << fd16.status();
  }
  // A shape too small to be worth timing takes the default, with tuning on.
  absl::StatusOr<std::unique_ptr<Runtime>> small = Runtime::Create(options);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE((*small)->ChooseFfnPlan(64, 32, ElementType::kFp32).ok());
  EXPECT_EQ((*small)->ffn_choices()[0].origin, FfnBlockingOrigin::kDefault);
  forced.ffn_blocking = "rows=99";
  absl::StatusOr<std::unique_ptr<Runtime>> bad = Runtime::Create(forced);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)->ChooseFfnPlan(2048, 768, ElementType::kFp32).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

TEST_F(ExpertFfnTest, QwenShapeFewRows) {
  const model::SyntheticWeights source = Preset("qwen1.5-moe-a2.7b", seed_);
  ASSERT_EQ(source.config().layer.hidden_size, 2048);
  ASSERT_EQ(source.config().layer.expert_ffn_size, 1408);
  // 3 local experts, experts 1 and 2 empty (RandomOffsets), 23 rows on expert 0:
  // one full register block and a remainder.
  Check(source, 17, 3, 9, 23);
  Check(source, 17, 3, 9, 23, {ElementType::kBf16, ElementType::kFp32, 0});
  Check(source, 40, 3, 1, 1, {ElementType::kBf16, ElementType::kBf16, 8});
}

TEST_F(ExpertFfnTest, BitIdenticalAcrossRuns) {
  const model::SyntheticWeights source = TinyShaped(/*hidden=*/136, /*ffn=*/88, 8, seed_);
  const uint32_t seed = seed_;
  for (const FfnTypes types : kAllTypes) {
    SCOPED_TRACE(Describe(types));
    rng_.seed(seed);
    const std::vector<float> a = Check(source, 0, 8, 64, 301, types);
    rng_.seed(seed);
    const std::vector<float> b = Check(source, 0, 8, 64, 301, types);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  }
}

// The dot kernels' two spellings of vdpbf16ps (clang's builtin, and the inline assembly that
// clang 16 and later need) give the same bits; where only the assembly builds, it is checked
// against the reference by the other tests and here against a second build of itself.
TEST_F(ExpertFfnTest, Bf16DotFormsAgreeBitForBit) {
  if (!Rt().bf16_dot()) GTEST_SKIP() << "the device runs no BF16 dot products";
  RuntimeOptions options = TestRuntimeOptions();
  options.bf16_dot_inline_asm = true;
  absl::StatusOr<std::unique_ptr<Runtime>> asm_rt = Runtime::Create(options);
  ASSERT_TRUE(asm_rt.ok()) << asm_rt.status();
  ASSERT_TRUE((*asm_rt)->bf16_dot()) << "the inline-assembly form did not build";
  // Odd K: a padded pair in both GEMMs.
  const model::SyntheticWeights source = TinyShaped(/*hidden=*/137, /*ffn=*/91, 8, seed_);
  const uint32_t seed = seed_;
  for (const FfnTypes types : std::span(kAllTypes).subspan(1)) {
    SCOPED_TRACE(Describe(types));
    rng_.seed(seed);
    const std::vector<float> builtin = Check(source, 0, 8, 64, 301, types);
    rt_ = asm_rt->get();
    rng_.seed(seed);
    const std::vector<float> inline_asm = Check(source, 0, 8, 64, 301, types);
    rt_ = nullptr;
    ASSERT_EQ(builtin.size(), inline_asm.size());
    EXPECT_EQ(std::memcmp(builtin.data(), inline_asm.data(), builtin.size() * sizeof(float)), 0);
  }
}

// Experts of at most kDotDirectRows rows run gate_up straight from x (ffn_gate_up_x_dot, no
// gather launch): every row block (1, 4 and 8 rows, for 1, 2-4 and 5-8 rows), odd K (a padded
// pair) past the last whole 16 pairs, FP32 and BF16 x in padded rows. Against the reference,
// and against the staged form on the same rows: an expert of more rows sends a whole call
// through the gather, and the other experts' rows must come out the same, bit for bit where
// both forms run vdpbf16ps (AMX tiles sum in their own order: there, within BF16's bound).
TEST_F(ExpertFfnTest, DotDirectRowsMatchTheStagedForm) {
  if (!Rt().bf16_dot()) GTEST_SKIP() << "the device runs no BF16 dot products";
  const model::SyntheticWeights source = TinyShaped(/*hidden=*/137, /*ffn=*/91, 4, seed_);
  const int64_t most = detail::kDotDirectRows;
  // Rows per expert: 1, 3, most, 5 (direct), then most + 1 in place of the last (staged).
  const std::vector<int64_t> direct = {0, 1, 4, 4 + most, 9 + most};
  const std::vector<int64_t> staged = {0, 1, 4, 4 + most, 5 + 2 * most};
  const int64_t shared_rows = 4 + most, h = source.config().layer.hidden_size;
  const uint32_t seed = seed_;
  for (const FfnTypes types : std::span(kAllTypes).subspan(1)) {
    if (types.weights != ElementType::kBf16) continue;
    SCOPED_TRACE(Describe(types));
    rng_.seed(seed);
    const std::vector<float> y_direct = Check(source, 0, 4, 24, direct.back(), types, direct);
    rng_.seed(seed);
    const std::vector<float> y_staged = Check(source, 0, 4, 24, staged.back(), types, staged);
    ASSERT_GE(y_direct.size(), static_cast<size_t>(shared_rows * h));
    ASSERT_GE(y_staged.size(), static_cast<size_t>(shared_rows * h));
    const std::vector<float> a(y_direct.begin(), y_direct.begin() + shared_rows * h);
    const std::vector<float> b(y_staged.begin(), y_staged.begin() + shared_rows * h);
    if (Rt().bf16_amx()) {
      EXPECT_LE(RelError(a, std::vector<double>(b.begin(), b.end())), kMaxRelErrorMma);
    } else {
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
    }
  }
}

// AMX tiles (Intel CPUs with AMX-BF16): the dot kernels' rows in tiles of up to 16 rows and
// 16 k pairs, the pairs past the last whole step through vdpbf16ps. Against the reference: K
// a multiple of 16 pairs (no rest) and not (a rest of 8, and odd K with a padded pair), from 1
// to 250 routed rows over 2-4 experts (partial tiles, whole ones, several). Elsewhere the
// BF16 tests run the same kernels on vdpbf16ps; this one says why it skips.
TEST_F(ExpertFfnTest, AmxTilesMatchTheReference) {
  if (!Rt().bf16_dot()) GTEST_SKIP() << "the device runs no BF16 dot products";
  if (!Rt().bf16_amx()) GTEST_SKIP() << "no AMX tiles: " << Rt().bf16_amx_why_not();
  const std::span<const FfnTypes> bf16_weights = std::span(kAllTypes).subspan(1);
  CheckShape(/*hidden=*/256, /*ffn=*/160, /*experts=*/2, /*tokens=*/64, bf16_weights, {16, 64});
  CheckShape(/*hidden=*/64, /*ffn=*/48, /*experts=*/2, /*tokens=*/40, bf16_weights,
             {1, 15, 16, 17, 33, 80});
  CheckShape(/*hidden=*/71, /*ffn=*/37, /*experts=*/4, /*tokens=*/60, bf16_weights, {1, 13, 250});
}

// A rebalance's upload: experts an earlier upload of the same layer holds are copied from it
// on the device, in any order, and the result is the fresh upload byte for byte; only the
// others are read from the source.
TEST_F(ExpertFfnTest, UploadReusingAnotherUploadMatchesAFreshOne) {
  const model::SyntheticWeights source = Preset("tiny", seed_);
  for (ElementType dtype : {ElementType::kFp32, ElementType::kBf16}) {
    const std::vector<int> held = {0, 1, 2, 3}, next = {3, 5, 0, 6};
    absl::StatusOr<ExpertWeights> old = UploadExperts(Rt(), source, 0, held, dtype);
    absl::StatusOr<ExpertWeights> reused = UploadExperts(Rt(), source, 0, next, dtype, &*old);
    absl::StatusOr<ExpertWeights> fresh = UploadExperts(Rt(), source, 0, next, dtype);
    ASSERT_TRUE(old.ok() && reused.ok() && fresh.ok());
    EXPECT_EQ(reused->bytes_from_source * 2, fresh->bytes_from_source);  // 2 of 4 read
    EXPECT_EQ(fresh->bytes_from_source, fresh->gate_up.bytes() + fresh->down.bytes());
    for (auto part : {&ExpertWeights::gate_up, &ExpertWeights::down}) {
      const Buffer& a = *reused.*part;
      const Buffer& b = *fresh.*part;
      ASSERT_EQ(a.bytes(), b.bytes());
      std::vector<char> ha(a.bytes(), 1), hb(b.bytes(), 2);
      ASSERT_TRUE(Rt().Read(a, 0, ha.data(), ha.size()).ok());
      ASSERT_TRUE(Rt().Read(b, 0, hb.data(), hb.size()).ok());
      EXPECT_EQ(std::memcmp(ha.data(), hb.data(), ha.size()), 0) << common::FlagName(dtype);
    }
  }
}

TEST_F(ExpertFfnTest, RejectsBadOffsets) {
  const model::SyntheticWeights source = Preset("tiny", seed_);
  absl::StatusOr<ExpertWeights> w = UploadExperts(Rt(), source, 0, 0, 2);
  ASSERT_TRUE(w.ok()) << w.status();
  Buffer x = Poisoned(64 * 4);
  Buffer idx = Upload(std::vector<int32_t>(4, 0));
  Buffer h = Poisoned(4 * 32);
  Buffer y = Poisoned(4 * 64);
  const std::vector<int64_t> wrong_size = {0, 4};
  const std::vector<int64_t> descending = {0, 3, 2};
  const std::vector<int64_t> too_many = {0, 2, 9};
  for (const auto* offsets : {&wrong_size, &descending, &too_many}) {
    absl::Status s = ExpertFfn(Rt(), *w, x, idx, *offsets, h, y);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  const std::vector<int64_t> fine = {0, 2, 4};
  absl::Status s = ExpertFfn(Rt(), *w, x, idx, fine, h, y, {ElementType::kBf16, 63});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Element types the kernels do not take are refused, not read as FP32.
  s = ExpertFfn(Rt(), *w, x, idx, fine, h, y, {ElementType::kFp16, 0});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(UploadExperts(Rt(), source, 0, 0, 2, ElementType::kFp16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- shared expert ----

// (preset, weight dtype).
using PresetAndDType = std::tuple<std::string, ElementType>;

std::string PresetAndDTypeName(const ::testing::TestParamInfo<PresetAndDType>& param_info) {
  std::string name = std::get<0>(param_info.param);
  std::replace(name.begin(), name.end(), '-', '_');
  return absl::StrCat(name, "_", common::FlagName(std::get<1>(param_info.param)));
}

class SharedExpertTest : public Seeded, public ::testing::WithParamInterface<PresetAndDType> {};

// With BF16 weights: against the FP32 reference at the BF16 bound.
TEST_P(SharedExpertTest, MatchesReference) {
  // The device's forms, then the work-group forms of GPUs (on any device).
  for (Runtime* forms : {static_cast<Runtime*>(nullptr), &WorkGroupFormsRt()}) {
    rt_ = forms;
    SCOPED_TRACE(forms == nullptr ? "the device's forms" : "the work-group forms");
    const auto& [preset, dtype] = GetParam();
    const model::SyntheticWeights source = Preset(preset, seed_);
    const model::MoeLayerConfig& cfg = source.config().layer;
    absl::StatusOr<model::LayerWeights> host = model::LoadLayer(source, 0);
    ASSERT_TRUE(host.ok()) << host.status();
    absl::StatusOr<ExpertWeights> w = UploadSharedExpert(R(), source, 0, dtype);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->gate.mem() != nullptr, cfg.shared_expert_gate);
    const int64_t h = cfg.hidden_size;
    for (int64_t n : {1, 7, 33, 300}) {
      SCOPED_TRACE(absl::StrCat("n=", n));
      const std::vector<float> x = Uniform(n * h);
      Buffer xb = Upload(x);
      Buffer hb = Poisoned(n * cfg.shared_ffn_size);
      Buffer yb = Poisoned(n * h);
      absl::Status s = SharedExpertFfn(R(), *w, xb, n, hb, yb);
      ASSERT_TRUE(s.ok()) << s;
      std::vector<double> ref(n * h, 0.0);
      for (int64_t i = 0; i < n; ++i) {
        const float* row = x.data() + i * h;
        double scale = 1.0;
        if (cfg.shared_expert_gate) {
          double dot = 0.0;
          for (int64_t c = 0; c < h; ++c)
            dot += static_cast<double>(row[c]) * host->shared_expert_gate[c];
          scale = 1.0 / (1.0 + std::exp(-dot));
        }
        model::ReferenceExpert(host->shared_gate.data(), host->shared_up.data(),
                               host->shared_down.data(), h, cfg.shared_ffn_size, row,
                               ref.data() + i * h, scale);
      }
      EXPECT_LE(RelError(Download<float>(yb, n * h), ref),
                dtype == ElementType::kBf16 ? kMaxRelErrorBf16 : kMaxRelErrorFp32);
    }
  }
  rt_ = nullptr;
}

INSTANTIATE_TEST_SUITE_P(Presets, SharedExpertTest,
                         ::testing::Combine(::testing::Values("tiny",
                                                              "tiny-grouped"),  // gated, ungated
                                            ::testing::Values(ElementType::kFp32,
                                                              ElementType::kBf16)),
                         PresetAndDTypeName);

// ---- combine ----

TEST_F(Seeded, WeightedCombineMatchesReference) {
  for (int64_t n : {1, 7, 33, 300}) {
    for (int k : {1, 2, 4}) {
      const int64_t hidden = 72;
      const int64_t rows = n * k + 5;
      SCOPED_TRACE(absl::StrCat("n=", n, " k=", k));
      const std::vector<float> y = Uniform(rows * hidden);
      const std::vector<float> pw = Uniform(n * k, 0.0f, 2.0f);
      std::vector<int32_t> pi(n * k);
      std::uniform_int_distribution<int32_t> row(0, static_cast<int32_t>(rows - 1));
      std::bernoulli_distribution dropped(0.2);
      for (int32_t& p : pi) p = dropped(rng_) ? -1 : row(rng_);
      Buffer yb = Upload(y);
      Buffer ib = Upload(pi);
      Buffer wb = Upload(pw);
      Buffer out = Poisoned(n * hidden);
      ASSERT_TRUE(WeightedCombine(Rt(), yb, ib, wb, n, k, hidden, out).ok());
      std::vector<double> ref(n * hidden, 0.0);
      for (int64_t i = 0; i < n; ++i) {
        for (int j = 0; j < k; ++j) {
          const int32_t p = pi[i * k + j];
          if (p < 0) continue;
          for (int64_t c = 0; c < hidden; ++c) {
            ref[i * hidden + c] += static_cast<double>(pw[i * k + j]) * y[p * hidden + c];
          }
        }
      }
      EXPECT_LE(RelError(Download<float>(out, n * hidden), ref), kMaxRelErrorFp32);
    }
  }
}

// Large Writes and Reads through the pinned staging buffers (forced on, so that CPU devices
// run the path too) move every byte, whatever the size against the chunk, the buffer offset
// and the host pointer's alignment; small ones and a Runtime without staging as well.
TEST_F(Seeded, StagedTransfersMoveEveryByte) {
  for (RuntimeOptions::Staging mode :
       {RuntimeOptions::Staging::kAlways, RuntimeOptions::Staging::kOff}) {
    RuntimeOptions options = TestRuntimeOptions();
    options.staging = mode;
    options.transfer_threads = 3;
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
    EXPECT_EQ((*rt)->stages_transfers(), mode == RuntimeOptions::Staging::kAlways);
    const size_t chunk = Runtime::kStagingChunk;
    const size_t max_bytes = 5 * chunk + 4096;
    absl::StatusOr<Buffer> buffer = (*rt)->Allocate(max_bytes + 64);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    for (size_t bytes : {size_t{1000}, Runtime::kStagedTransferMin - 4, Runtime::kStagedTransferMin,
                         2 * chunk + chunk / 2, 5 * chunk + 3}) {
      for (size_t offset : {size_t{0}, size_t{12}}) {
        for (size_t misalign : {size_t{0}, size_t{5}}) {
          SCOPED_TRACE(absl::StrCat("bytes ", bytes, " offset ", offset, " host misaligned by ",
                                    misalign, " staging ",
                                    mode == RuntimeOptions::Staging::kAlways));
          std::vector<unsigned char> src(bytes + misalign), dst(bytes + misalign, 0xA5);
          for (size_t i = misalign; i < src.size(); i += 8) {
            const uint64_t word = rng_();
            std::memcpy(&src[i], &word, std::min<size_t>(8, src.size() - i));
          }
          ASSERT_TRUE((*rt)->Write(*buffer, offset, src.data() + misalign, bytes).ok());
          ASSERT_TRUE((*rt)->Read(*buffer, offset, dst.data() + misalign, bytes).ok());
          EXPECT_EQ(std::memcmp(dst.data() + misalign, src.data() + misalign, bytes), 0);
        }
      }
    }
    // A kernel between the two sees what was written and is seen by the read.
    const std::vector<float> v = Uniform(3 * chunk / sizeof(float));
    ASSERT_TRUE((*rt)->Write(*buffer, 0, v.data(), v.size() * sizeof(float)).ok());
    ASSERT_TRUE(RoundToBf16(**rt, *buffer, static_cast<int64_t>(v.size()), *buffer).ok());
    std::vector<float> got(v.size(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE((*rt)->Read(*buffer, 0, got.data(), got.size() * sizeof(float)).ok());
    for (size_t i = 0; i < v.size(); i += 997) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]),
                std::bit_cast<uint32_t>(common::Bf16ToFloat(common::FloatToBf16(v[i]))))
          << i;
    }
  }
}

// The device's owner sum has the host sum's bits (worker::WeightedSumRows: each product
// rounded, then added in order; this file is built with -ffp-contract=off, so the reference
// below fuses nothing either), for every start and with and without BF16 rounding.
TEST_F(Seeded, SumPairRowsHasTheHostSumsBits) {
  auto round_bf16 = [](float v) { return common::Bf16ToFloat(common::FloatToBf16(v)); };
  for (int64_t n : {1, 7, 33, 300}) {
    for (int k : {1, 2, 4, 8}) {
      for (SumStart start :
           {SumStart::kZero, SumStart::kOnto, SumStart::kAsPart, SumStart::kAsPart}) {
        // kAsPart twice: one part, then three (a split shared expert's slices of 3 workers).
        const int parts = start == SumStart::kAsPart && (n + k) % 2 == 0 ? 3 : 1;
        for (bool round : {false, true}) {
          const int64_t hidden = 72;
          const int64_t rows = n * k + 5;
          SCOPED_TRACE(absl::StrCat("n=", n, " k=", k, " start=", static_cast<int>(start),
                                    " parts=", parts, " round=", round));
          const std::vector<float> y = Uniform(rows * hidden, -3.0f, 3.0f);
          const std::vector<float> pw = Uniform(n * k, 0.0f, 1.0f);
          const std::vector<float> base = Uniform(parts * n * hidden, -2.0f, 2.0f);
          std::vector<int32_t> pi(n * k);
          std::uniform_int_distribution<int32_t> row(0, static_cast<int32_t>(rows - 1));
          for (int32_t& p : pi) p = row(rng_);
          Buffer yb = Upload(y);
          Buffer ib = Upload(pi);
          Buffer wb = Upload(pw);
          Buffer bb = Upload(base);
          // Out of place, then in place onto base.
          Buffer out = Poisoned(n * hidden);
          ASSERT_TRUE(
              SumPairRows(Rt(), yb, ib, wb, n, k, hidden, &bb, start, round, out, parts).ok());
          std::vector<float> ref(n * hidden);
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t c = 0; c < hidden; ++c) {
              const float b = base[i * hidden + c];
              float acc = 0.0f;
              if (start == SumStart::kOnto) acc = b;
              for (int p = 0; start == SumStart::kAsPart && p < parts; ++p) {
                const float v = base[(p * n + i) * hidden + c];
                const float part = 1.0f * (round ? round_bf16(v) : v);
                acc = acc + part;
              }
              for (int j = 0; j < k; ++j) {
                const float v = y[pi[i * k + j] * hidden + c];
                const float product = pw[i * k + j] * (round ? round_bf16(v) : v);
                acc = acc + product;
              }
              ref[i * hidden + c] = acc;
            }
          }
          const std::vector<float> got = Download<float>(out, n * hidden);
          EXPECT_EQ(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)), 0);
          ASSERT_TRUE(
              SumPairRows(Rt(), yb, ib, wb, n, k, hidden, &bb, start, round, bb, parts).ok());
          const std::vector<float> in_place = Download<float>(bb, n * hidden);
          EXPECT_EQ(std::memcmp(in_place.data(), ref.data(), ref.size() * sizeof(float)), 0);
        }
      }
    }
  }
  // A pair index outside y is loud (NaN), and a start from base needs one.
  Buffer yb = Upload(Uniform(4 * 8));
  Buffer ib = Upload(std::vector<int32_t>{0, 4});
  Buffer wb = Upload(std::vector<float>{0.5f, 0.5f});
  Buffer out = Poisoned(8);
  ASSERT_TRUE(SumPairRows(Rt(), yb, ib, wb, 1, 2, 8, nullptr, SumStart::kZero, false, out).ok());
  for (float v : Download<float>(out, 8)) EXPECT_TRUE(std::isnan(v));
  EXPECT_FALSE(SumPairRows(Rt(), yb, ib, wb, 1, 2, 8, nullptr, SumStart::kOnto, false, out).ok());
  // Several parts only as parts.
  EXPECT_FALSE(SumPairRows(Rt(), yb, ib, wb, 1, 2, 8, &yb, SumStart::kOnto, false, out, 2).ok());
}

// CopyRows moves each (source row, destination row) pair of a run of moves, rounding to BF16
// values where asked, and writes nothing for a move outside either buffer (the destination may
// be another process's memory); in each form: the device's, per value, and whole rows per
// work-group with one group, with an odd count of groups (a group's second row past the run),
// and with more groups than rows; rows narrower than a group and wider than it.
TEST_F(Seeded, CopyRowsMovesEachRowOfItsRunAndNothingElse) {
  auto round_bf16 = [](float v) { return common::Bf16ToFloat(common::FloatToBf16(v)); };
  for (int64_t hidden : {1, 72, 1100, 2048})
    for (int64_t groups : {0, -1, 1, 3, 64})
      for (bool round : {false, true}) {
        SCOPED_TRACE(absl::StrCat("hidden=", hidden, " groups=", groups, " round=", round));
        const int64_t src_rows = 37, dst_rows = 50;
        const std::vector<float> src = Uniform(src_rows * hidden, -5.0f, 5.0f);
        // A run of moves in the middle of the list (first = 3), a permutation of distinct rows,
        // then two moves out of bounds.
        std::vector<int32_t> moves = {9, 9, 9, 9, 9, 9};  // moves before the run: not taken
        std::vector<int32_t> dst_of(src_rows);
        std::iota(dst_of.begin(), dst_of.end(), 0);
        std::shuffle(dst_of.begin(), dst_of.end(), rng_);
        for (int32_t r = 0; r < src_rows; ++r) {
          moves.push_back(r);
          moves.push_back(dst_of[r] + 13);
        }
        moves.insert(moves.end(), {0, static_cast<int32_t>(dst_rows), -1, 0});
        const int64_t count = src_rows + 2;
        Buffer sb = Upload(src);
        Buffer mb = Upload(moves);
        const std::vector<float> poison(dst_rows * hidden, -777.0f);
        Buffer db = Upload(poison);
        ASSERT_TRUE(CopyRows(Rt(), sb, mb, 3, count, hidden, round, db, groups).ok());
        const std::vector<float> got = Download<float>(db, dst_rows * hidden);
        for (int64_t d = 0; d < dst_rows; ++d) {
          const int64_t s =
              d >= 13 ? std::find(dst_of.begin(), dst_of.end(), d - 13) - dst_of.begin() : src_rows;
          for (int64_t c = 0; c < hidden; ++c) {
            const float want = s < src_rows
                                   ? (round ? round_bf16(src[s * hidden + c]) : src[s * hidden + c])
                                   : -777.0f;
            ASSERT_EQ(std::bit_cast<uint32_t>(got[d * hidden + c]), std::bit_cast<uint32_t>(want))
                << "row " << d << " column " << c;
          }
        }
      }
  Buffer sb = Upload(Uniform(8));
  Buffer mb = Upload(std::vector<int32_t>{0, 0});
  Buffer db = Poisoned(8);
  EXPECT_FALSE(CopyRows(Rt(), sb, mb, 0, 2, 8, false, db).ok());  // moves past the buffer
  EXPECT_FALSE(CopyRows(Rt(), sb, mb, -1, 1, 8, false, db).ok());
  EXPECT_FALSE(CopyRows(Rt(), sb, mb, 0, 1, 8, false, db, -2).ok());
}

// WriteAsync copies a piece of pinned host memory into a buffer at an offset without waiting,
// the bytes there once the queue has run; memory not from AllocatePinnedHost (or a piece
// reaching past it) and a piece past the buffer are refused.
TEST_F(Seeded, WriteAsyncCopiesFromPinnedMemory) {
  absl::StatusOr<void*> pinned = Rt().AllocatePinnedHost(4096 * sizeof(int32_t));
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  int32_t* table = static_cast<int32_t*>(*pinned);
  std::uniform_int_distribution<int32_t> any(-1000000, 1000000);
  for (int i = 0; i < 4096; ++i) table[i] = any(rng_);
  std::vector<int32_t> poison(2048, -777);
  Buffer b = Upload(poison);
  ASSERT_TRUE(Rt().WriteAsync(b, 64 * sizeof(int32_t), table + 10, 1000 * sizeof(int32_t)).ok());
  ASSERT_TRUE(Rt().Finish().ok());
  std::vector<int32_t> want = poison;
  std::copy_n(table + 10, 1000, want.begin() + 64);
  EXPECT_EQ(Download<int32_t>(b, 2048), want);
  EXPECT_EQ(Rt().WriteAsync(b, 0, poison.data(), 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rt().WriteAsync(b, 0, table + 4000, 100 * sizeof(int32_t)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rt().WriteAsync(b, 2000 * sizeof(int32_t), table, 100 * sizeof(int32_t)).code(),
            absl::StatusCode::kOutOfRange);
}

// ReadAsync the other way: a piece of a buffer into pinned memory at an offset, there once the
// queue has run, the pinned memory around it untouched; the same refusals.
TEST_F(Seeded, ReadAsyncCopiesIntoPinnedMemory) {
  absl::StatusOr<void*> pinned = Rt().AllocatePinnedHost(4096 * sizeof(int32_t));
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  int32_t* table = static_cast<int32_t*>(*pinned);
  std::fill_n(table, 4096, -777);
  std::uniform_int_distribution<int32_t> any(-1000000, 1000000);
  std::vector<int32_t> values(2048);
  for (int32_t& v : values) v = any(rng_);
  const Buffer b = Upload(values);
  ASSERT_TRUE(Rt().ReadAsync(b, 64 * sizeof(int32_t), table + 10, 1000 * sizeof(int32_t)).ok());
  ASSERT_TRUE(Rt().Finish().ok());
  std::vector<int32_t> want(4096, -777);
  std::copy_n(values.begin() + 64, 1000, want.begin() + 10);
  EXPECT_EQ(std::vector<int32_t>(table, table + 4096), want);
  std::vector<int32_t> pageable(16);
  EXPECT_EQ(Rt().ReadAsync(b, 0, pageable.data(), 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rt().ReadAsync(b, 0, table + 4000, 100 * sizeof(int32_t)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rt().ReadAsync(b, 2000 * sizeof(int32_t), table, 100 * sizeof(int32_t)).code(),
            absl::StatusCode::kOutOfRange);
}

// CopyRowRuns moves every run's rows from its source into its destination as CopyRows would,
// over more runs than one launch takes (an empty run among them, a run reading a source
// another run reads too, moves out of bounds), in each form.
TEST_F(Seeded, CopyRowRunsMovesEachRunIntoItsOwnDestination) {
  auto round_bf16 = [](float v) { return common::Bf16ToFloat(common::FloatToBf16(v)); };
  for (int64_t hidden : {1, 72, 1100})
    for (int64_t groups : {0, 1, 3, 64})
      for (bool round : {false, true}) {
        SCOPED_TRACE(absl::StrCat("hidden=", hidden, " groups=", groups, " round=", round));
        const int64_t src_rows[2] = {23, 31};
        const std::vector<float> src[2] = {Uniform(src_rows[0] * hidden, -5.0f, 5.0f),
                                           Uniform(src_rows[1] * hidden, -5.0f, 5.0f)};
        Buffer sb[2] = {Upload(src[0]), Upload(src[1])};
        constexpr int kRuns = 6;
        const int64_t dst_rows = 29;
        const int source_of[kRuns] = {0, 1, 0, 1, 0, 1};
        const int64_t counts[kRuns] = {5, 0, 17, 29, 1, 12};
        std::vector<int32_t> moves = {3, 3};              // a move before the first run: not taken
        std::vector<std::vector<int32_t>> dst_of(kRuns);  // per run: source row of each dst row
        std::vector<RowRun> runs(kRuns);
        std::vector<Buffer> db;
        // Runs 2 and 5 are blocks where the form takes them, some of their rows past the end
        // of the source or the destination.
        const bool blocks = RowRunsTakeBlocks(Rt(), hidden, round, groups);
        for (int r = 0; r < kRuns; ++r) {
          dst_of[r].assign(dst_rows, -1);
          std::vector<int32_t> rows(dst_rows);
          std::iota(rows.begin(), rows.end(), 0);
          std::shuffle(rows.begin(), rows.end(), rng_);
          runs[r].first = static_cast<int64_t>(moves.size() / 2);
          runs[r].count = counts[r];
          std::uniform_int_distribution<int32_t> from(0, src_rows[source_of[r]] - 1);
          if (blocks && (r == 2 || r == 5)) {
            runs[r].first = 0;
            runs[r].block_src = from(rng_);
            runs[r].block_dst = std::uniform_int_distribution<int64_t>(0, dst_rows - 1)(rng_);
            for (int64_t i = 0; i < counts[r]; ++i) {
              const int64_t s = runs[r].block_src + i, d = runs[r].block_dst + i;
              if (s < src_rows[source_of[r]] && d < dst_rows)
                dst_of[r][d] = static_cast<int32_t>(s);
            }
            db.push_back(Upload(std::vector<float>(dst_rows * hidden, -777.0f)));
            continue;
          }
          for (int64_t i = 0; i < counts[r]; ++i) {
            const int32_t s = i == 3 ? static_cast<int32_t>(src_rows[source_of[r]]) : from(rng_);
            const int32_t d = i == 4 ? -1 : rows[i];
            moves.push_back(s);
            moves.push_back(d);
            if (i != 3 && i != 4) dst_of[r][d] = s;
          }
          db.push_back(Upload(std::vector<float>(dst_rows * hidden, -777.0f)));
        }
        Buffer mb = Upload(moves);
        for (int r = 0; r < kRuns; ++r) {
          runs[r].src = &sb[source_of[r]];
          runs[r].dst = &db[r];
        }
        ASSERT_TRUE(CopyRowRuns(Rt(), runs, mb, hidden, round, groups).ok());
        for (int r = 0; r < kRuns; ++r) {
          const std::vector<float> got = Download<float>(db[r], dst_rows * hidden);
          const std::vector<float>& from = src[source_of[r]];
          for (int64_t d = 0; d < dst_rows; ++d) {
            const int32_t s = dst_of[r][d];
            for (int64_t c = 0; c < hidden; ++c) {
              const float v = s < 0 ? -777.0f : from[s * hidden + c];
              const float want = s >= 0 && round ? round_bf16(v) : v;
              ASSERT_EQ(std::bit_cast<uint32_t>(got[d * hidden + c]), std::bit_cast<uint32_t>(want))
                  << "run " << r << " row " << d << " column " << c;
            }
          }
        }
      }
  Buffer sb = Upload(Uniform(8));
  Buffer mb = Upload(std::vector<int32_t>{0, 0});
  Buffer db = Poisoned(8);
  const RowRun past[1] = {{&sb, &db, 0, 2}};  // moves past the buffer
  EXPECT_FALSE(CopyRowRuns(Rt(), past, mb, 8, false).ok());
  const RowRun negative[1] = {{&sb, &db, -1, 1}};
  EXPECT_FALSE(CopyRowRuns(Rt(), negative, mb, 8, false).ok());
  const RowRun one[1] = {{&sb, &db, 0, 1}};
  EXPECT_FALSE(CopyRowRuns(Rt(), one, mb, 8, false, -1).ok());
  // A block rounded to BF16 where the form reads moves, or with a negative destination, in
  // either form.
  Buffer sb6 = Upload(Uniform(12));
  Buffer db6 = Poisoned(12);
  const RowRun block6[1] = {{&sb6, &db6, 0, 1, 0, 0}};
  EXPECT_FALSE(RowRunsTakeBlocks(Rt(), 6, true));
  EXPECT_TRUE(RowRunsTakeBlocks(Rt(), 6, false));
  EXPECT_EQ(CopyRowRuns(Rt(), block6, mb, 6, true).code(), absl::StatusCode::kInvalidArgument);
  const RowRun below[1] = {{&sb, &db, 0, 1, 0, -1}};
  for (int64_t groups : {0, 2}) {
    EXPECT_EQ(CopyRowRuns(Rt(), below, mb, 8, false, groups).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// ReturnRows sends each pair's row to its sender's pairs at the pair's home and each received
// row's part to its sender's parts at me * tokens + token, from the pair table on the device,
// for 2 senders and for 6 (two launches), in each form, and writes nothing for a pair of no
// sender, a home past the sender's buffer or a token past its count.
TEST_F(Seeded, ReturnRowsSendsEachRowToItsSenderFromThePairTable) {
  for (int senders : {2, 6})
    for (int64_t hidden : {1, 6, 72, 1100})
      for (int64_t groups : {0, -1, 3})
        for (bool parts : {false, true}) {
          SCOPED_TRACE(absl::StrCat("senders=", senders, " hidden=", hidden, " groups=", groups,
                                    " parts=", parts));
          const int me = senders - 1;
          std::vector<int64_t> begin(senders + 1, 0), tokens(senders);
          std::uniform_int_distribution<int64_t> few(0, 9);
          for (int s = 0; s < senders; ++s) {
            begin[s + 1] = begin[s] + few(rng_);  // rows from s (some none), distinct tokens
            tokens[s] = begin[s + 1] - begin[s] + 1 + few(rng_) % 3;
          }
          const int64_t rows = begin[senders];
          const int k = 3;
          const int64_t home_rows = 12 * k, part_rows = senders * 12;
          // Pairs: each received row's, some with bad entries.
          std::vector<int32_t> pair_row, pair_home, token(rows);
          for (int s = 0; s < senders; ++s) {
            std::vector<int32_t> ids(tokens[s]);
            std::iota(ids.begin(), ids.end(), 0);
            std::shuffle(ids.begin(), ids.end(), rng_);
            for (int64_t r = begin[s]; r < begin[s + 1]; ++r) {
              token[r] = ids[r - begin[s]];
              for (int j = 0; j < 2; ++j) {
                pair_row.push_back(static_cast<int32_t>(r));
                pair_home.push_back(static_cast<int32_t>(token[r] * k + j));
              }
            }
          }
          pair_row.push_back(static_cast<int32_t>(rows));  // no sender
          pair_home.push_back(0);
          if (rows > 0) {
            pair_row.push_back(0);  // a home past the buffer
            pair_home.push_back(static_cast<int32_t>(home_rows));
          }
          const int64_t pairs = static_cast<int64_t>(pair_row.size());
          // The last received row names a token past its sender's count when parts are moved.
          int bad_row_sender = -1;
          if (rows > 0) {
            for (int s = 0; s < senders; ++s) {
              if (begin[s] <= rows - 1 && rows - 1 < begin[s + 1]) bad_row_sender = s;
            }
            token[rows - 1] = static_cast<int32_t>(tokens[bad_row_sender]);
          }
          const std::vector<float> pair_vals = Uniform(pairs * hidden, -3.0f, 3.0f);
          const std::vector<float> part_vals =
              Uniform(std::max<int64_t>(rows, 1) * hidden, -3.0f, 3.0f);
          Buffer pb = Upload(pair_vals), rb = Upload(part_vals);
          std::vector<int32_t> tables = pair_row;
          tables.insert(tables.end(), pair_home.begin(), pair_home.end());
          if (parts) tables.insert(tables.end(), token.begin(), token.end());
          Buffer tb = Upload(tables);
          std::vector<Buffer> pd, qd;
          for (int s = 0; s < senders; ++s) {
            pd.push_back(Upload(std::vector<float>(home_rows * hidden, -777.0f)));
            qd.push_back(Upload(std::vector<float>(part_rows * hidden, -777.0f)));
          }
          std::vector<const Buffer*> pairs_to, parts_to;
          for (int s = 0; s < senders; ++s) {
            pairs_to.push_back(&pd[s]);
            parts_to.push_back(&qd[s]);
          }
          ReturnRowsArgs a;
          a.pair_rows = &pb;
          a.row_parts = parts ? &rb : nullptr;
          a.pairs_to = pairs_to;
          a.parts_to = parts_to;
          a.source_begin = begin;
          a.tokens = tokens;
          a.tables = &tb;
          a.pairs = pairs;
          a.rows = parts ? rows : 0;
          a.me = me;
          a.hidden = hidden;
          a.groups = groups;
          ASSERT_TRUE(ReturnRows(Rt(), a).ok());
          for (int s = 0; s < senders; ++s) {
            std::vector<float> want_pairs(home_rows * hidden, -777.0f);
            for (int64_t p = 0; p < pairs; ++p) {
              if (pair_row[p] < begin[s] || pair_row[p] >= begin[s + 1] ||
                  pair_home[p] >= home_rows) {
                continue;
              }
              std::copy_n(&pair_vals[p * hidden], hidden, &want_pairs[pair_home[p] * hidden]);
            }
            std::vector<float> want_parts(part_rows * hidden, -777.0f);
            for (int64_t r = begin[s]; r < begin[s + 1] && parts; ++r) {
              if (token[r] >= tokens[s]) continue;
              std::copy_n(&part_vals[r * hidden], hidden,
                          &want_parts[(me * tokens[s] + token[r]) * hidden]);
            }
            EXPECT_EQ(Download<float>(pd[s], home_rows * hidden), want_pairs)
                << "pairs of sender " << s;
            EXPECT_EQ(Download<float>(qd[s], part_rows * hidden), want_parts)
                << "parts of sender " << s;
          }
        }
  Buffer b = Upload(Uniform(8));
  const Buffer* one[1] = {&b};
  const int64_t begin[2] = {0, 1}, tokens[1] = {1};
  ReturnRowsArgs a;
  a.pair_rows = &b;
  a.pairs_to = one;
  a.source_begin = begin;
  a.tokens = tokens;
  a.tables = &b;
  a.pairs = 1;
  a.hidden = 8;
  a.me = 1;  // not a sender
  EXPECT_FALSE(ReturnRows(Rt(), a).ok());
  a.me = 0;
  a.rows = 1;  // rows without parts
  EXPECT_FALSE(ReturnRows(Rt(), a).ok());
}

TEST_F(Seeded, RoundToBf16RoundsAsTheHostDoes) {
  std::vector<float> v = Uniform(4096, -1e3f, 1e3f);
  for (uint32_t bits : {0x3F808000u, 0x3F818000u, 0x3F80FFFFu, 0x7F7FFFFFu, 0xFF7FFFFFu,
                        0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFA00000u,
                        0x00000001u, 0x80000000u, 0x00000000u, 0x007FFFFFu}) {
    v.push_back(std::bit_cast<float>(bits));  // ties, the largest finite, infinities, NaNs,
  }                                           // subnormals, zeros
  Buffer src = Upload(v);
  Buffer dst = Poisoned(v.size());
  ASSERT_TRUE(RoundToBf16(Rt(), src, static_cast<int64_t>(v.size()), dst).ok());
  const std::vector<float> got = Download<float>(dst, v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t want = std::bit_cast<uint32_t>(common::Bf16ToFloat(common::FloatToBf16(v[i])));
    EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), want)
        << "input bits " << std::hex << std::bit_cast<uint32_t>(v[i]);
  }
  ASSERT_TRUE(RoundToBf16(Rt(), src, static_cast<int64_t>(v.size()), src).ok());  // in place
  EXPECT_EQ(std::memcmp(Download<float>(src, v.size()).data(), got.data(), got.size() * 4), 0);
}

// ---- the whole layer through the public launchers ----

// route -> expert-major layout on the host -> ExpertFfn -> SharedExpertFfn -> WeightedCombine
// (the shared expert's rows are appended to y and combined with weight 1), against
// model::ReferenceForward. Tokens within rounding of a routing tie are not compared.
// With BF16 the expert weights are BF16 and so are the routed experts' input rows (padded
// rows, as a BF16 dispatch delivers them), checked at the BF16 bound against the FP32
// reference: the kernel-level stand-in for a BF16 request through --weight-dtype=bf16.
class LayerTest : public Seeded, public ::testing::WithParamInterface<PresetAndDType> {};

TEST_P(LayerTest, ComposesToReferenceForward) {
  const auto& [preset, dtype] = GetParam();
  const model::SyntheticWeights source = Preset(preset, seed_);
  const model::MoeLayerConfig& cfg = source.config().layer;
  absl::StatusOr<model::LayerWeights> host = model::LoadLayer(source, 0);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<RouterWeights> rw = UploadRouter(Rt(), source, 0);
  absl::StatusOr<ExpertWeights> ew = UploadExperts(Rt(), source, 0, 0, cfg.num_experts, dtype);
  ASSERT_TRUE(rw.ok() && ew.ok());
  const bool shared = cfg.shared_ffn_size > 0;
  absl::StatusOr<ExpertWeights> sw;
  if (shared) {
    sw = UploadSharedExpert(Rt(), source, 0, dtype);
    ASSERT_TRUE(sw.ok()) << sw.status();
  }
  const int64_t n = 33;
  const int64_t h = cfg.hidden_size;
  const int k = cfg.top_k;
  const std::vector<float> x = Uniform(n * h, -2.0f, 2.0f);
  Buffer xb = Upload(x);
  Buffer ids = Poisoned(n * k);
  Buffer weights = Poisoned(n * k);
  ASSERT_TRUE(Route(Rt(), *rw, xb, n, ids, weights).ok());
  const std::vector<int32_t> id = Download<int32_t>(ids, n * k);
  const std::vector<float> wt = Download<float>(weights, n * k);

  std::vector<int64_t> offsets(cfg.num_experts + 1, 0);
  for (int32_t e : id) ++offsets[e + 1];
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  const int kk = k + (shared ? 1 : 0);
  std::vector<int32_t> row_index(n * k), pair_index(n * kk);
  std::vector<float> pair_weight(n * kk);
  for (int64_t t = 0; t < n; ++t) {
    for (int j = 0; j < k; ++j) {
      const int64_t p = cursor[id[t * k + j]]++;
      row_index[p] = static_cast<int32_t>(t);
      pair_index[t * kk + j] = static_cast<int32_t>(p);
      pair_weight[t * kk + j] = wt[t * k + j];
    }
    if (shared) {
      pair_index[t * kk + k] = static_cast<int32_t>(n * k + t);
      pair_weight[t * kk + k] = 1.0f;
    }
  }
  const int64_t y_rows = n * k + (shared ? n : 0);
  Buffer ib = Upload(row_index);
  Buffer hb = Poisoned(n * std::max(k * cfg.expert_ffn_size, cfg.shared_ffn_size));
  Buffer yb = Poisoned(y_rows * h);
  if (dtype == ElementType::kBf16) {
    const RowFormat format{ElementType::kBf16, h + 24};
    Buffer x16 = Upload(Bf16Rows(x, h, format.row_stride));
    ASSERT_TRUE(ExpertFfn(Rt(), *ew, x16, ib, offsets, hb, yb, format).ok());
  } else {
    ASSERT_TRUE(ExpertFfn(Rt(), *ew, xb, ib, offsets, hb, yb).ok());
  }
  if (shared) {
    absl::StatusOr<Buffer> ys = Rt().Allocate(n * h * sizeof(float));
    ASSERT_TRUE(ys.ok());
    ASSERT_TRUE(SharedExpertFfn(Rt(), *sw, xb, n, hb, *ys).ok());
    std::vector<float> tmp = Download<float>(*ys, n * h);
    ASSERT_TRUE(Rt().Write(yb, n * k * h * sizeof(float), tmp.data(), tmp.size() * 4).ok());
  }
  Buffer pib = Upload(pair_index);
  Buffer pwb = Upload(pair_weight);
  Buffer out = Poisoned(n * h);
  ASSERT_TRUE(WeightedCombine(Rt(), yb, pib, pwb, n, kk, h, out).ok());
  const std::vector<float> got = Download<float>(out, n * h);

  std::vector<float> ref_out(n * h);
  model::Routing routing;
  model::ReferenceForward(cfg, *host, x.data(), n, ref_out.data(), &routing);
  std::vector<float> got_checked;
  std::vector<double> ref_checked;
  for (int64_t t = 0; t < n; ++t) {
    if (routing.margins[t] < kMarginWithinRounding) continue;
    got_checked.insert(got_checked.end(), got.begin() + t * h, got.begin() + (t + 1) * h);
    ref_checked.insert(ref_checked.end(), ref_out.begin() + t * h, ref_out.begin() + (t + 1) * h);
  }
  ASSERT_GT(got_checked.size(), static_cast<size_t>(n * h / 2));
  // The reference output is itself rounded to float, so allow that on top of FP32 error.
  EXPECT_LE(RelError(got_checked, ref_checked),
            dtype == ElementType::kBf16 ? kMaxRelErrorBf16 : 2 * kMaxRelErrorFp32);
}

INSTANTIATE_TEST_SUITE_P(
    Presets, LayerTest,
    ::testing::Combine(::testing::Values("tiny", "tiny-grouped", "tiny-topk-softmax"),
                       ::testing::Values(ElementType::kFp32, ElementType::kBf16)),
    PresetAndDTypeName);

}  // namespace
}  // namespace epserve::kernels
