// Every kernel against model/'s reference, with fresh random inputs each run (the seed is
// printed on failure) and outputs poisoned with NaN before each run so unwritten rows fail.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "model/weights.h"

namespace epserve::kernels {
namespace {

constexpr double kMaxRelErrorFp32 = 1e-5;
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

// One random seed per test, printed with every failure.
class Seeded : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    trace_ =
        std::make_unique<::testing::ScopedTrace>(__FILE__, __LINE__, absl::StrCat("seed=", seed_));
  }
  std::vector<float> Uniform(size_t count, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(count);
    for (float& f : v) f = dist(rng_);
    return v;
  }
  static Runtime& Rt() {
    static std::unique_ptr<Runtime> rt = [] {
      absl::StatusOr<std::unique_ptr<Runtime>> r = Runtime::Create(RuntimeOptions{});
      EXPECT_TRUE(r.ok()) << r.status();
      return r.ok() ? *std::move(r) : nullptr;
    }();
    return *rt;
  }
  // A device buffer holding `v`.
  template <typename T>
  Buffer Upload(const std::vector<T>& v) {
    absl::StatusOr<Buffer> b = Rt().Allocate(std::max<size_t>(v.size(), 1) * sizeof(T));
    EXPECT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(Rt().Write(*b, 0, v.data(), v.size() * sizeof(T)).ok());
    return *std::move(b);
  }
  // A device buffer of `count` floats (or ints) filled with NaN bits.
  Buffer Poisoned(size_t count) {
    return Upload(std::vector<float>(count, std::numeric_limits<float>::quiet_NaN()));
  }
  template <typename T>
  std::vector<T> Download(const Buffer& b, size_t count) {
    std::vector<T> v(count);
    absl::Status s = Rt().Read(b, 0, v.data(), count * sizeof(T));
    EXPECT_TRUE(s.ok()) << s;
    return v;
  }

  uint32_t seed_ = 0;
  std::mt19937_64 rng_;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

model::SyntheticWeights Preset(const std::string& name, uint64_t seed) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset(name);
  EXPECT_TRUE(cfg.ok()) << cfg.status();
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
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(RuntimeOptions{});
  ASSERT_TRUE(rt.ok()) << rt.status();
  absl::Status s = (*rt)->BuildProgramForTest(
      "__kernel void broken(__global float* x) { x[0] = undeclared_symbol_q7; }\n");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("CL_BUILD_PROGRAM_FAILURE"), std::string::npos) << s;
  EXPECT_NE(s.message().find("undeclared_symbol_q7"), std::string::npos) << s;  // from the log
  EXPECT_TRUE(
      (*rt)->BuildProgramForTest("__kernel void fine(__global float* x) { x[0] = 1; }").ok());
}

TEST(RuntimeTest, ProgramCacheIsWrittenThenReused) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      absl::StrCat("epserve-kernel-cache-test-", std::random_device{}());
  std::filesystem::remove_all(dir);
  RuntimeOptions options;
  options.cache_dir = dir.string();
  {
    absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(options);
    ASSERT_TRUE(rt.ok()) << rt.status();
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
    // The cached program runs: out = 2 * y[1] + 0.5 * y[0].
    const std::vector<float> y = {1, 2, 3, 4, 5, 6};
    const std::vector<int32_t> index = {1, 0};
    const std::vector<float> weight = {2.0f, 0.5f};
    absl::StatusOr<Buffer> yb = r.AllocateCopy(y.data(), y.size() * sizeof(float));
    absl::StatusOr<Buffer> ib = r.AllocateCopy(index.data(), index.size() * sizeof(int32_t));
    absl::StatusOr<Buffer> wb = r.AllocateCopy(weight.data(), weight.size() * sizeof(float));
    absl::StatusOr<Buffer> out = r.Allocate(3 * sizeof(float));
    ASSERT_TRUE(yb.ok() && ib.ok() && wb.ok() && out.ok());
    ASSERT_TRUE(WeightedCombine(r, *yb, *ib, *wb, 1, 2, 3, *out).ok());
    std::vector<float> got(3);
    ASSERT_TRUE(r.Read(*out, 0, got.data(), 3 * sizeof(float)).ok());
    EXPECT_EQ(got, (std::vector<float>{2 * 4 + 0.5f * 1, 2 * 5 + 0.5f * 2, 2 * 6 + 0.5f * 3}));
  }
  std::filesystem::remove_all(dir);
}

// ---- route ----

class RouteTest : public Seeded, public ::testing::WithParamInterface<std::string> {};

TEST_P(RouteTest, MatchesReference) {
  const model::SyntheticWeights source = Preset(GetParam(), seed_);
  const model::MoeLayerConfig& cfg = source.config().layer;
  absl::StatusOr<model::LayerWeights> host = model::LoadLayer(source, 0);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<RouterWeights> w = UploadRouter(Rt(), source, 0);
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
    ASSERT_TRUE(Route(Rt(), *w, xb, n, ids, weights).ok());
    const std::vector<int32_t> got_ids = Download<int32_t>(ids, n * k);
    const std::vector<float> got_w = Download<float>(weights, n * k);
    // A second run gives the same bits.
    Buffer weights2 = Poisoned(n * k);
    ASSERT_TRUE(Route(Rt(), *w, xb, n, ids, weights2).ok());
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

INSTANTIATE_TEST_SUITE_P(Presets, RouteTest,
                         ::testing::Values("tiny", "tiny-grouped", "tiny-topk-softmax"),
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

struct FfnCase {
  std::vector<float> gate, up, down;  // per local expert, concatenated
};

// Reference outputs y[p] = FFN_e(x[row_index[p]]) in double.
std::vector<double> ReferenceFfn(const std::vector<const float*>& gate,
                                 const std::vector<const float*>& up,
                                 const std::vector<const float*>& down, int64_t hidden, int64_t ffn,
                                 const std::vector<float>& x, const std::vector<int32_t>& row_index,
                                 const std::vector<int64_t>& offsets) {
  std::vector<double> y(offsets.back() * hidden, 0.0);
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    for (int64_t p = offsets[e]; p < offsets[e + 1]; ++p) {
      model::ReferenceExpert(gate[e], up[e], down[e], hidden, ffn, x.data() + row_index[p] * hidden,
                             y.data() + p * hidden, 1.0);
    }
  }
  return y;
}

class ExpertFfnTest : public Seeded {
 protected:
  // Runs ExpertFfn over experts [first, first + count) of `source` for `pairs` rows drawn
  // from `tokens` token rows and checks it against the reference. Returns y.
  std::vector<float> Check(const model::WeightSource& source, int first, int count, int64_t tokens,
                           int64_t pairs) {
    const model::MoeLayerConfig& cfg = source.config().layer;
    const int64_t h = cfg.hidden_size;
    const int64_t f = cfg.expert_ffn_size;
    std::vector<std::vector<float>> gate(count), up(count), down(count);
    std::vector<const float*> gp, up_p, dp;
    for (int e = 0; e < count; ++e) {
      gate[e].resize(f * h);
      up[e].resize(f * h);
      down[e].resize(h * f);
      EXPECT_TRUE(source.Fill(0, model::TensorKind::kExpertGate, first + e, gate[e].data()).ok());
      EXPECT_TRUE(source.Fill(0, model::TensorKind::kExpertUp, first + e, up[e].data()).ok());
      EXPECT_TRUE(source.Fill(0, model::TensorKind::kExpertDown, first + e, down[e].data()).ok());
      gp.push_back(gate[e].data());
      up_p.push_back(up[e].data());
      dp.push_back(down[e].data());
    }
    absl::StatusOr<ExpertWeights> w = UploadExperts(Rt(), source, 0, first, count);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return {};
    const std::vector<float> x = Uniform(tokens * h);
    const std::vector<int64_t> offsets = RandomOffsets(rng_, count, pairs);
    std::vector<int32_t> row_index(pairs);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(tokens - 1));
    for (int32_t& r : row_index) r = token(rng_);
    Buffer xb = Upload(x);
    Buffer ib = Upload(row_index);
    Buffer hb = Poisoned(pairs * f);
    Buffer yb = Poisoned(pairs * h);
    absl::Status s = ExpertFfn(Rt(), *w, xb, ib, offsets, hb, yb);
    EXPECT_TRUE(s.ok()) << s;
    const std::vector<float> y = Download<float>(yb, pairs * h);
    const std::vector<double> ref = ReferenceFfn(gp, up_p, dp, h, f, x, row_index, offsets);
    EXPECT_LE(RelError(y, ref), kMaxRelErrorFp32)
        << "H=" << h << " F=" << f << " experts=" << count << " pairs=" << pairs;
    return y;
  }
};

TEST_F(ExpertFfnTest, TinyPresetsAllExperts) {
  for (const char* preset : {"tiny", "tiny-grouped", "tiny-topk-softmax"}) {
    const model::SyntheticWeights source = Preset(preset, seed_);
    for (int64_t pairs : {1, 7, 33, 300}) {
      SCOPED_TRACE(absl::StrCat(preset, " pairs=", pairs));
      Check(source, 0, source.config().layer.num_experts, /*tokens=*/pairs + 3, pairs);
    }
  }
}

TEST_F(ExpertFfnTest, SubsetOfExperts) {
  const model::SyntheticWeights source = Preset("tiny-grouped", seed_);
  Check(source, 5, 6, 40, 97);
}

TEST_F(ExpertFfnTest, ShapeNotAMultipleOfTheTiles) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
  ASSERT_TRUE(cfg.ok());
  cfg->layer.hidden_size = 72;
  cfg->layer.expert_ffn_size = 40;
  cfg->layer.num_experts = 5;
  const model::SyntheticWeights source(*cfg, seed_);
  for (int64_t pairs : {1, 7, 33, 300}) {
    SCOPED_TRACE(absl::StrCat("pairs=", pairs));
    Check(source, 0, 5, 50, pairs);
  }
}

TEST_F(ExpertFfnTest, QwenShapeFewRows) {
  const model::SyntheticWeights source = Preset("qwen1.5-moe-a2.7b", seed_);
  ASSERT_EQ(source.config().layer.hidden_size, 2048);
  ASSERT_EQ(source.config().layer.expert_ffn_size, 1408);
  // 3 local experts, experts 1 and 2 empty (RandomOffsets), 23 rows on expert 0:
  // one full register block and a remainder.
  Check(source, 17, 3, 9, 23);
}

TEST_F(ExpertFfnTest, BitIdenticalAcrossRuns) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
  ASSERT_TRUE(cfg.ok());
  cfg->layer.hidden_size = 136;
  cfg->layer.expert_ffn_size = 88;
  const model::SyntheticWeights source(*cfg, seed_);
  const uint32_t seed = seed_;
  rng_.seed(seed);
  const std::vector<float> a = Check(source, 0, 8, 64, 301);
  rng_.seed(seed);
  const std::vector<float> b = Check(source, 0, 8, 64, 301);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
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
}

// ---- shared expert ----

class SharedExpertTest : public Seeded, public ::testing::WithParamInterface<std::string> {};

TEST_P(SharedExpertTest, MatchesReference) {
  const model::SyntheticWeights source = Preset(GetParam(), seed_);
  const model::MoeLayerConfig& cfg = source.config().layer;
  absl::StatusOr<model::LayerWeights> host = model::LoadLayer(source, 0);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<ExpertWeights> w = UploadSharedExpert(Rt(), source, 0);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->gate.mem() != nullptr, cfg.shared_expert_gate);
  const int64_t h = cfg.hidden_size;
  for (int64_t n : {1, 7, 33, 300}) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    const std::vector<float> x = Uniform(n * h);
    Buffer xb = Upload(x);
    Buffer hb = Poisoned(n * cfg.shared_ffn_size);
    Buffer yb = Poisoned(n * h);
    absl::Status s = SharedExpertFfn(Rt(), *w, xb, n, hb, yb);
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
    EXPECT_LE(RelError(Download<float>(yb, n * h), ref), kMaxRelErrorFp32);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, SharedExpertTest,
                         ::testing::Values("tiny", "tiny-grouped"),  // gated, ungated
                         PresetTestName);

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

// ---- the whole layer through the public launchers ----

// route -> expert-major layout on the host -> ExpertFfn -> SharedExpertFfn -> WeightedCombine
// (the shared expert's rows are appended to y and combined with weight 1), against
// model::ReferenceForward. Tokens within rounding of a routing tie are not compared.
class LayerTest : public Seeded, public ::testing::WithParamInterface<std::string> {};

TEST_P(LayerTest, ComposesToReferenceForward) {
  const model::SyntheticWeights source = Preset(GetParam(), seed_);
  const model::MoeLayerConfig& cfg = source.config().layer;
  absl::StatusOr<model::LayerWeights> host = model::LoadLayer(source, 0);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<RouterWeights> rw = UploadRouter(Rt(), source, 0);
  absl::StatusOr<ExpertWeights> ew = UploadExperts(Rt(), source, 0, 0, cfg.num_experts);
  ASSERT_TRUE(rw.ok() && ew.ok());
  const bool shared = cfg.shared_ffn_size > 0;
  absl::StatusOr<ExpertWeights> sw;
  if (shared) {
    sw = UploadSharedExpert(Rt(), source, 0);
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
  ASSERT_TRUE(ExpertFfn(Rt(), *ew, xb, ib, offsets, hb, yb).ok());
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
  EXPECT_LE(RelError(got_checked, ref_checked), 2 * kMaxRelErrorFp32);
}

INSTANTIATE_TEST_SUITE_P(Presets, LayerTest,
                         ::testing::Values("tiny", "tiny-grouped", "tiny-topk-softmax"),
                         PresetTestName);

}  // namespace
}  // namespace epserve::kernels
