// Times the grouped expert FFN (gate/up + SwiGLU + down) for the qwen1.5-moe-a2.7b expert
// shape, with FP32 and BF16 weights, against (a) OpenBLAS sgemm alone on the same GEMM shapes
// (contiguous inputs, best thread count: the figure the targets are judged against) and (b) the
// whole FFN through OpenBLAS (gather, three GEMMs, a C++ SwiGLU loop); for small row counts,
// the weight bytes streamed per second against memcpy. Every figure printed is measured in
// this run: medians of several repetitions after warm-up, all variants timed round-robin so
// that they see the same machine conditions.
//
//   bench_expert_ffn [--experts=4] [--rows=1,8,32,128,512,2048] [--threads=2]
#include <cblas.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_support.h"
#include "common/flags.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/synthetic.h"

extern "C" char* openblas_get_config(void);
extern "C" char* openblas_get_corename(void);
extern "C" void openblas_set_num_threads(int);

namespace epserve::kernels {
namespace {

using bench::NowSeconds;
using common::ElementType;

// Timing of the variants of one case, with this benchmark's repetition counts; `settle` runs
// before each timed call.
std::vector<double> RoundRobinMedianSeconds(const std::vector<std::function<void()>>& fns,
                                            const std::function<void(size_t)>& settle) {
  return bench::RoundRobinMedianSeconds(fns, 2, 7, 41, 3.0, nullptr, settle);
}

// Row counts per expert up to which the weight streaming is compared with memcpy.
constexpr int64_t kStreamingRows = 8;
// A memcpy of kMemcpyBytes on `threads` threads, each copying its slice, for the round-robin
// timing of the small-row cases (so that it sees the machine conditions the kernels see).
constexpr size_t kMemcpyBytes = size_t{512} << 20;
void ParallelMemcpy(bench::ThreadTeam& team, char* dst, const char* src, int threads) {
  const size_t slice = kMemcpyBytes / threads;
  team.Run(threads, [&](int t) { std::memcpy(dst + t * slice, src + t * slice, slice); });
}

// The thread counts memcpy and the read floor are timed on: 1, 2, 4, ... and `threads`.
std::vector<int> StreamThreadCounts(int threads) {
  std::vector<int> counts;
  for (int t = 1; t < threads; t *= 2) counts.push_back(t);
  counts.push_back(threads);
  return counts;
}

// Reads the first `bytes` of src once on `threads` threads, each summing its slice (eight
// independent sums, so loads are not serialised behind adds): the read-only stream floor of
// the few-row cases, whose kernels only read their weights. The sums go to a volatile sink.
volatile float g_read_sink = 0;
void ParallelRead(bench::ThreadTeam& team, const float* src, size_t bytes, int threads) {
  const size_t slice = bytes / sizeof(float) / threads / 8 * 8;
  std::vector<float> sums(threads, 0.0f);
  team.Run(threads, [&](int t) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float* p = src + t * slice;
    for (size_t i = 0; i < slice; i += 8) {
      for (int j = 0; j < 8; ++j) s[j] += p[i + j];
    }
    sums[t] = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
  });
  for (float v : sums) g_read_sink = g_read_sink + v;
}

// The plain read of the BF16 weights' bytes: a buffer of that size in transparent huge pages
// (as the runtime allocates weights on CPU devices), summed by `threads` threads (the kernels'
// pool: PoCL runs a thread per compute unit) 64 bytes a load with four independent vector
// sums. What the FFN's few-row forms, which only stream their weights, could reach.
using Vec16 = float __attribute__((vector_size(64)));
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
float SumVectors(const Vec16* p, size_t n) {
  Vec16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
  for (size_t i = 0; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  const Vec16 sum = s0 + s1 + s2 + s3;
  float r = 0;
  for (int j = 0; j < 16; ++j) r += sum[j];
  return r;
}
class PlainRead {
 public:
  explicit PlainRead(size_t bytes) : bytes_(bytes / 256 * 256) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t rounded = (bytes_ + kHuge - 1) / kHuge * kHuge;
    data_ = static_cast<Vec16*>(std::aligned_alloc(kHuge, rounded));
    madvise(data_, rounded, MADV_HUGEPAGE);
    const size_t n = bytes_ / sizeof(Vec16);
    for (size_t i = 0; i < n; ++i) data_[i] = Vec16{} + 1e-3f;
  }
  ~PlainRead() { std::free(data_); }
  PlainRead(const PlainRead&) = delete;
  PlainRead& operator=(const PlainRead&) = delete;
  size_t bytes() const { return bytes_; }
  void Run(bench::ThreadTeam& team, int threads) {
    const size_t n = bytes_ / sizeof(Vec16);
    const size_t slice = n / threads / 4 * 4;
    std::vector<float> sums(threads, 0.0f);
    team.Run(threads, [&](int t) {
      const size_t count = t + 1 == threads ? n - t * slice : slice;
      sums[t] = SumVectors(data_ + t * slice, count);
    });
    for (float v : sums) sink_ = sink_ + v;
  }

 private:
  size_t bytes_;
  Vec16* data_ = nullptr;
  static inline volatile float sink_ = 0;
};

// The FP32 multiply-add peak of the kernels' vector width (16 lanes: AVX-512, 8: AVX2 and
// FMA) on the kernels' threads: twelve independent chains of vfmadd each, more than the
// latency x issue width of any x86 core so far. A kernel that multiplies m rows by each weight
// with FP32 FMAs does 2m flops per weight, so it can consume at most peak / (2m) weights a
// second, whatever the memory gives: the compute side of the few-row forms' bound.
constexpr int kFmaChains = 12;
#if defined(__x86_64__) && defined(__GNUC__)
#define EPSERVE_FMA_CHAINS(NAME, TARGET, VEC, SET1, FMADD, LANES)          \
  __attribute__((target(TARGET))) float NAME(int64_t iterations) {         \
    const VEC m = SET1(0.999f), c = SET1(1e-3f);                           \
    VEC a[kFmaChains];                                                     \
    for (int j = 0; j < kFmaChains; ++j) a[j] = SET1(1.0f + j);            \
    for (int64_t n = 0; n < iterations; ++n) {                             \
      for (int j = 0; j < kFmaChains; ++j) a[j] = FMADD(a[j], m, c);       \
    }                                                                      \
    float sum = 0;                                                         \
    for (int j = 0; j < kFmaChains; ++j) sum += a[j][0] + a[j][LANES - 1]; \
    return sum;                                                            \
  }
EPSERVE_FMA_CHAINS(FmaChains512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, 16)
EPSERVE_FMA_CHAINS(FmaChains256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, 8)
#undef EPSERVE_FMA_CHAINS
#endif
class FmaPeak {
 public:
  // lanes: the kernels' native float vector width; 0 flops when the host has no such FMAs.
  explicit FmaPeak(int lanes) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (lanes >= 16 && __builtin_cpu_supports("avx512f")) {
      lanes_ = 16;
    } else if (lanes >= 8 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      lanes_ = 8;
    }
#else
    (void)lanes;
#endif
  }
  int lanes() const { return lanes_; }
  // The flops of one Run on `threads` threads.
  double flops(int threads) const { return 2.0 * kFmaChains * lanes_ * kIterations * threads; }
  void Run(bench::ThreadTeam& team, int threads) {
    if (lanes_ == 0) return;
    std::vector<float> sums(threads, 0.0f);
    team.Run(threads, [&](int t) {
#if defined(__x86_64__) && defined(__GNUC__)
      sums[t] = lanes_ == 16 ? FmaChains512(kIterations) : FmaChains256(kIterations);
#endif
    });
    for (float v : sums) sink_ = sink_ + v;
  }

 private:
  static constexpr int64_t kIterations = 1 << 18;  // about 0.5 ms at 100 GFLOP/s a core
  int lanes_ = 0;
  static inline volatile float sink_ = 0;
};

// One form of the FFN timed on the weights of one runtime (kernels/ffn_blocking.h).
struct FormRun {
  Runtime* rt;
  const ExpertWeights* w;
  FfnBlocking form;
  bool chosen;  // the form the runtime's plan picks for the row count
  double t = 0;
};

// The forms of the weights' layout that `rt` could pick for `rows` rows per expert.
// `main`: rt is the runtime whose choices the benchmark reports (the other serves the other
// layout only).
void AddForms(Runtime& rt, const ExpertWeights& w, int64_t rows, bool main,
              std::vector<FormRun>& out) {
  if (w.tensor_cores) return;
  for (const FfnBlocking& b : rt.FfnFormCandidates(w.dtype)) {
    if (!SameFfnLayout(b, w.blocking) || !FfnFormServes(b, FfnRowClass(rows))) continue;
    out.push_back({&rt, &w, b, main && w.plan.For(rows) == b});
  }
}

// max |a - ref| / max |ref|.
double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0.0;
  double scale = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - ref[i])));
    scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// Prints why the benchmark cannot go on; the exit code.
int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
  return 1;
}

// The device buffers of one FFN case on one runtime: x (FP32), row_index, h and y.
struct FfnBuffers {
  Buffer x, row_index, h, y;
};
absl::StatusOr<FfnBuffers> MakeFfnBuffers(Runtime& rt, const std::vector<float>& x,
                                          const std::vector<int32_t>& row_index, int64_t ffn,
                                          int64_t hidden) {
  const int64_t pairs = static_cast<int64_t>(row_index.size());
  absl::StatusOr<Buffer> xb = rt.AllocateCopy(x.data(), x.size() * sizeof(float));
  absl::StatusOr<Buffer> ib = rt.AllocateCopy(row_index.data(), pairs * sizeof(int32_t));
  absl::StatusOr<Buffer> hb = rt.Allocate(pairs * ffn * sizeof(float));
  absl::StatusOr<Buffer> yb = rt.Allocate(pairs * hidden * sizeof(float));
  for (const absl::StatusOr<Buffer>* b : {&xb, &ib, &hb, &yb}) {
    if (!b->ok()) return b->status();
  }
  return FfnBuffers{*std::move(xb), *std::move(ib), *std::move(hb), *std::move(yb)};
}

// The figures of one row count, printed in tables at the end.
struct Result {
  int64_t rows = 0;                             // per expert
  double t_fp32 = 0, t_bf16 = 0, t_bf16_x = 0;  // epserve: FP32 weights, BF16 weights,
                                                // BF16 weights and BF16 activations
  // BF16 weights on the path the runtime did not choose (dot or FP32 FMA; 0: not run).
  double t_bf16_other = 0;
  double diff_bf16_other = 0;
  double t_sgemm = 0;  // (a) pure sgemm, best thread count
  int sgemm_threads = 0;
  double t_composite = 0;                                // (b) gather + 3 sgemm + SwiGLU loop
  double diff_fp32 = 0, diff_bf16 = 0, diff_bf16_x = 0;  // against (b)
  double memcpy_bps = 0;      // read + write bytes/s, small row counts only
  double read_bps = 0;        // a plain read-only stream of the FP32 weights' size, likewise
  double plain_bf16_bps = 0;  // PlainRead of the BF16 weights' bytes, kernels' threads
  double fma_flops = 0;       // FmaPeak on the kernels' threads, flops/s
  std::vector<FormRun> forms;
};

int Run(int argc, char** argv) {
  int num_experts = 4;
  int threads = 2;
  std::vector<int64_t> rows_per_expert = {1, 8, 32, 128, 512, 2048};
  common::FlagSet fs("bench_expert_ffn",
                     "The grouped expert FFN against OpenBLAS sgemm and memcpy, same run.");
  fs.Add("experts", &num_experts, "Experts of the qwen1.5-moe-a2.7b shape per case");
  fs.Add("rows", &rows_per_expert, "Comma list of rows per expert");
  fs.Add("threads", &threads, "OpenBLAS and memcpy threads at most");
  RuntimeOptions runtime_options;
  fs.Add("bf16-dot", &runtime_options.bf16_dot,
         "BF16 weights through AVX512-BF16 dot products where the CPU has them");
  fs.Add("bf16-amx", &runtime_options.bf16_amx,
         "The dot-product kernels' rows through AMX tiles where the CPU has AMX-BF16");
  const int code = bench::ParseFlags(
      fs, argc, argv,
      [&] { return num_experts >= 1 && threads >= 1 && bench::AllPositive(rows_per_expert); },
      "--experts, --threads and every --rows entry must be >= 1");
  if (code >= 0) return code;
  bench::PrintCoretype();
  openblas_set_num_threads(threads);
  std::printf("OpenBLAS: %s, core %s, up to %d threads\n", openblas_get_config(),
              openblas_get_corename(), threads);
  const char* pocl_threads = std::getenv("POCL_MAX_PTHREAD_COUNT");
  std::printf("POCL_MAX_PTHREAD_COUNT=%s\n", pocl_threads != nullptr ? pocl_threads : "(unset)");

  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("qwen1.5-moe-a2.7b");
  if (!cfg.ok()) return Fail(cfg.status());
  const model::SyntheticWeights source(*cfg, 1234);
  const int64_t hidden = cfg->layer.hidden_size;
  const int64_t ffn = cfg->layer.expert_ffn_size;

  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(runtime_options);
  if (!rt.ok()) return Fail(rt.status());
  Runtime& r = **rt;
  std::printf("host %s\n", bench::HostIsa().c_str());
  std::printf("device: %s (native float vector width %d, %d compute units%s%s)\n",
              r.device_info().Describe().c_str(), r.device_info().native_float_width,
              r.device_info().compute_units,
              r.device_info().target_isa.empty() ? "" : ", code built for ",
              r.device_info().target_isa.c_str());
  absl::StatusOr<ExpertWeights> w32 = UploadExperts(r, source, 0, 0, num_experts);
  absl::StatusOr<ExpertWeights> w16 =
      UploadExperts(r, source, 0, 0, num_experts, ElementType::kBf16);
  if (!w32.ok() || !w16.ok()) return Fail((w32.ok() ? w16 : w32).status());
  std::printf("BF16 weights run on: %s\n", FfnKernelsName(r, *w16));
  if (r.bf16_dot()) {
    std::printf("AMX tiles: %s\n",
                r.bf16_amx() ? "yes" : absl::StrCat("no (", r.bf16_amx_why_not(), ")").c_str());
  }
  for (const FfnChoice& c : r.ffn_choices()) {
    std::printf("FFN blocking: %s (%.2f s to choose)\n", c.Describe().c_str(), c.seconds);
  }
  // Where the runtime has the BF16 dot-product kernels, the same BF16 weights in the layout it
  // did not choose (a second runtime: without the dot kernels, or with "dot" forced) are
  // timed in the same run, every form of both layouts, so that the choice is seen against the
  // alternatives.
  std::unique_ptr<Runtime> other_rt;
  absl::StatusOr<ExpertWeights> w16_other = absl::UnavailableError("not used");
  if (r.bf16_dot()) {
    RuntimeOptions other_options = runtime_options;
    if (w16->bf16_dot) {
      other_options.bf16_dot = false;
    } else {
      other_options.ffn_blocking = "dot";
    }
    absl::StatusOr<std::unique_ptr<Runtime>> created = Runtime::Create(other_options);
    if (!created.ok()) return Fail(created.status());
    other_rt = *std::move(created);
    w16_other = UploadExperts(*other_rt, source, 0, 0, num_experts, ElementType::kBf16);
    if (!w16_other.ok()) return Fail(w16_other.status());
  }
  // Host weights for OpenBLAS, Hugging Face layout: gate_up[e] = [gate; up] ([2F, H]), so that
  // gate and up are one GEMM; down[e] [H, F].
  std::vector<std::vector<float>> gate_up(num_experts), down(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    gate_up[e].resize(2 * ffn * hidden);
    down[e].resize(hidden * ffn);
    if (!source.Fill(0, model::TensorKind::kExpertGate, e, gate_up[e].data()).ok() ||
        !source.Fill(0, model::TensorKind::kExpertUp, e, gate_up[e].data() + ffn * hidden).ok() ||
        !source.Fill(0, model::TensorKind::kExpertDown, e, down[e].data()).ok()) {
      return 1;
    }
  }
  const double weight_bytes_fp32 = 3.0 * hidden * ffn * sizeof(float) * num_experts;
  const double weight_bytes_bf16 = weight_bytes_fp32 / 2;
  std::printf("shape: H=%lld F=%lld, %d experts, %.0f MiB of FP32 expert weights (%.0f MiB BF16)\n",
              static_cast<long long>(hidden), static_cast<long long>(ffn), num_experts,
              weight_bytes_fp32 / (1 << 20), weight_bytes_bf16 / (1 << 20));
  bench::PrintLoadAverage("before");

  // The kernels' threads: PoCL runs one per compute unit (POCL_MAX_PTHREAD_COUNT caps both).
  const int kernel_threads = std::max(1, r.device_info().compute_units);
  // The baselines' threads (memcpy, the read floor, the plain read), started once.
  bench::ThreadTeam team(std::max(threads, kernel_threads));
  PlainRead plain_read(static_cast<size_t>(weight_bytes_bf16));
  FmaPeak fma_peak(r.device_info().native_float_width);
  cl_ulong cache_bytes = 0;
  if (clGetDeviceInfo(r.device(), CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, sizeof(cache_bytes),
                      &cache_bytes, nullptr) != CL_SUCCESS ||
      cache_bytes == 0) {
    cache_bytes = cl_ulong{64} << 20;
  }
  PlainRead evict(2 * static_cast<size_t>(cache_bytes));
  std::printf("between timed calls: a read of %.0f MiB (twice the device's cache)\n",
              evict.bytes() / double(1 << 20));
  std::vector<Result> results;
  std::vector<std::vector<double>> form_diffs_all;  // per result, per form
  bench::IdleThreadsWait idle_threads;
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t m : rows_per_expert) {
    std::fprintf(stderr, "rows/expert %lld ...\n", static_cast<long long>(m));
    const int64_t pairs = m * num_experts;
    std::vector<float> x(pairs * hidden);
    for (float& v : x) v = dist(rng);
    std::vector<uint16_t> x16(x.size());
    for (size_t i = 0; i < x.size(); ++i) x16[i] = FloatToBf16(x[i]);
    std::vector<int32_t> row_index(pairs);  // every row gathered from a shuffled token
    std::iota(row_index.begin(), row_index.end(), 0);
    std::shuffle(row_index.begin(), row_index.end(), rng);
    std::vector<int64_t> offsets(num_experts + 1);
    for (int e = 0; e <= num_experts; ++e) offsets[e] = e * m;

    absl::StatusOr<FfnBuffers> bufs = MakeFfnBuffers(r, x, row_index, ffn, hidden);
    absl::StatusOr<Buffer> xb16 = r.AllocateCopy(x16.data(), x16.size() * sizeof(uint16_t));
    if (!bufs.ok() || !xb16.ok()) return 1;
    // The other BF16 path's runtime's copies, when it runs.
    absl::StatusOr<FfnBuffers> other_bufs = absl::UnavailableError("not used");
    if (other_rt != nullptr) {
      other_bufs = MakeFfnBuffers(*other_rt, x, row_index, ffn, hidden);
      if (!other_bufs.ok()) return 1;
    }
    bool failed = false;
    std::vector<float> y(pairs * hidden);
    auto run_on = [&](Runtime& on, const ExpertWeights& w, FfnBuffers& b, const Buffer& xin,
                      RowFormat format) {
      absl::Status s = ExpertFfn(on, w, xin, b.row_index, offsets, b.h, b.y, format);
      if (s.ok()) s = on.Finish();
      if (!s.ok() && !failed) {
        std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
        failed = true;
      }
    };
    auto run_epserve = [&](const ExpertWeights& w, const Buffer& xin, RowFormat format) {
      run_on(r, w, *bufs, xin, format);
    };
    auto run_other = [&] {
      run_on(*other_rt, *w16_other, *other_bufs, other_bufs->x, RowFormat{});
    };
    auto read_y = [&](Runtime& on, const FfnBuffers& b) {
      if (!on.Read(b.y, 0, y.data(), y.size() * sizeof(float)).ok()) failed = true;
      return y;
    };
    const RowFormat fp32_rows;
    const RowFormat bf16_rows{ElementType::kBf16, 0};

    // (a) OpenBLAS at its best: per expert, the gate+up GEMM [rows x 2F x H] and the down GEMM
    // [rows x H x F] on contiguous inputs, nothing else.
    std::vector<float> xc(pairs * hidden), gu(pairs * 2 * ffn), hc(pairs * ffn), yc(pairs * hidden);
    for (size_t i = 0; i < xc.size(); ++i) xc[i] = dist(rng);
    for (size_t i = 0; i < hc.size(); ++i) hc[i] = dist(rng);
    auto run_sgemm = [&](int nthreads) {
      openblas_set_num_threads(nthreads);
      for (int e = 0; e < num_experts; ++e) {
        const int64_t p0 = offsets[e];
        const int rows = static_cast<int>(offsets[e + 1] - p0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, 2 * ffn, hidden, 1.0f,
                    &xc[p0 * hidden], hidden, gate_up[e].data(), hidden, 0.0f, &gu[p0 * 2 * ffn],
                    2 * ffn);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, hidden, ffn, 1.0f, &hc[p0 * ffn],
                    ffn, down[e].data(), ffn, 0.0f, &yc[p0 * hidden], hidden);
      }
    };
    // (b) the whole FFN through OpenBLAS: gather the rows, G = X Wg^T, U = X Wu^T,
    // A = silu(G) * U (a plain C++ loop), Y = A Wd^T, per expert.
    std::vector<float> xg(pairs * hidden), g(pairs * ffn), u(pairs * ffn), y_blas(pairs * hidden);
    auto run_composite = [&] {
      openblas_set_num_threads(threads);
      for (int64_t p = 0; p < pairs; ++p) {
        std::memcpy(&xg[p * hidden], &x[row_index[p] * hidden], hidden * sizeof(float));
      }
      for (int e = 0; e < num_experts; ++e) {
        const int64_t p0 = offsets[e];
        const int rows = static_cast<int>(offsets[e + 1] - p0);
        const float* wg = gate_up[e].data();
        const float* wu = wg + ffn * hidden;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ffn, hidden, 1.0f,
                    &xg[p0 * hidden], hidden, wg, hidden, 0.0f, &g[p0 * ffn], ffn);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ffn, hidden, 1.0f,
                    &xg[p0 * hidden], hidden, wu, hidden, 0.0f, &u[p0 * ffn], ffn);
        for (int64_t i = p0 * ffn; i < (p0 + rows) * ffn; ++i) {
          g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, hidden, ffn, 1.0f, &g[p0 * ffn],
                    ffn, down[e].data(), ffn, 0.0f, &y_blas[p0 * hidden], hidden);
      }
    };

    Result res;
    res.rows = m;
    // Outputs of each epserve variant against (b), before timing.
    run_composite();
    run_epserve(*w32, bufs->x, fp32_rows);
    res.diff_fp32 = MaxRelDiff(read_y(r, *bufs), y_blas);
    run_epserve(*w16, bufs->x, fp32_rows);
    res.diff_bf16 = MaxRelDiff(read_y(r, *bufs), y_blas);
    run_epserve(*w16, *xb16, bf16_rows);
    res.diff_bf16_x = MaxRelDiff(read_y(r, *bufs), y_blas);
    if (other_rt != nullptr) {
      run_other();
      res.diff_bf16_other = MaxRelDiff(read_y(*other_rt, *other_bufs), y_blas);
    }
    // Every form the runtimes could pick for m rows per expert, checked like the rest.
    AddForms(r, *w32, m, true, res.forms);
    AddForms(r, *w16, m, true, res.forms);
    if (other_rt != nullptr) AddForms(*other_rt, *w16_other, m, false, res.forms);
    std::vector<double> form_diffs;
    auto run_form = [&](const FormRun& f) {
      FfnBuffers& b = f.rt == &r ? *bufs : *other_bufs;
      absl::Status st = ExpertFfnAs(*f.rt, *f.w, f.form, b.x, b.row_index, offsets, b.h, b.y);
      if (st.ok()) st = f.rt->Finish();
      if (!st.ok() && !failed) {
        std::fprintf(stderr, "%s: %s\n", f.form.ToString().c_str(),
                     std::string(st.message()).c_str());
        failed = true;
      }
    };
    for (const FormRun& f : res.forms) {
      run_form(f);
      form_diffs.push_back(MaxRelDiff(read_y(*f.rt, f.rt == &r ? *bufs : *other_bufs), y_blas));
    }

    std::vector<std::function<void()>> fns;
    const size_t first_form = fns.size();
    for (const FormRun& f : res.forms) fns.push_back([&, f] { run_form(f); });
    const size_t first_epserve = fns.size();
    fns.push_back([&] { run_epserve(*w32, bufs->x, fp32_rows); });
    fns.push_back([&] { run_epserve(*w16, bufs->x, fp32_rows); });
    fns.push_back([&] { run_epserve(*w16, *xb16, bf16_rows); });
    const size_t other_index = fns.size();
    if (other_rt != nullptr) fns.push_back(run_other);
    const size_t first_openblas = fns.size();
    fns.push_back(run_composite);
    for (int t = 1; t <= threads; ++t) fns.push_back([&, t] { run_sgemm(t); });
    // For the streaming ratios, memcpy on 1, 2, 4, ... --threads threads joins the
    // round-robin: the machine's memory bandwidth drifts by 1.5x within minutes here, and only
    // interleaved timings see the same conditions.
    const size_t first_memcpy = fns.size();
    std::vector<char> copy_src, copy_dst;
    std::vector<float> read_src;
    size_t first_read = fns.size();
    if (m <= kStreamingRows) {
      copy_src.assign(kMemcpyBytes, 1);
      copy_dst.assign(kMemcpyBytes, 0);
      for (int t : StreamThreadCounts(threads)) {
        fns.push_back([&, t] { ParallelMemcpy(team, copy_dst.data(), copy_src.data(), t); });
      }
      // The read floor streams as many bytes as the FP32 weights, from memory (beyond L3).
      first_read = fns.size();
      read_src.assign(static_cast<size_t>(weight_bytes_fp32 / sizeof(float)), 1e-3f);
      for (int t : StreamThreadCounts(threads)) {
        fns.push_back(
            [&, t] { ParallelRead(team, read_src.data(), read_src.size() * sizeof(float), t); });
      }
      fns.push_back([&] { fma_peak.Run(team, kernel_threads); });
      fns.push_back([&] { plain_read.Run(team, kernel_threads); });
    }
    // OpenBLAS's idle workers keep spinning on sched_yield for about 0.1 s after each call, so
    // before each timed call of epserve's kernels (and of memcpy) the benchmark waits for them
    // to stop; otherwise they would share the two cores with what is timed next. The OpenBLAS
    // variants run back to back, their workers warm, as in their own use.
    // Before each of the others, the cache is emptied of what the call before left there
    // (a read of twice the device's cache size): a call that streams weights found a fifth
    // of its time's worth of them in the 32 MiB L3 of the Zen 5 host when the call before it
    // read the same weights, so that the order of the variants decided their times. Serving
    // a model, each call's weights are out of cache (the other layers' stream between).
    std::vector<bool> settle_before(fns.size(), true);
    for (size_t i = first_openblas; i < first_memcpy; ++i) settle_before[i] = false;
    std::function<void(size_t)> idle = idle_threads.Before(settle_before);
    const std::vector<double> med = RoundRobinMedianSeconds(fns, [&](size_t i) {
      if (settle_before[i]) evict.Run(team, kernel_threads);
      idle(i);
    });
    if (failed) return 1;
    res.t_fp32 = med[first_epserve];
    res.t_bf16 = med[first_epserve + 1];
    res.t_bf16_x = med[first_epserve + 2];
    if (other_rt != nullptr) res.t_bf16_other = med[other_index];
    res.t_composite = med[first_openblas];
    res.t_sgemm = med[first_openblas + 1];
    res.sgemm_threads = 1;
    for (int t = 2; t <= threads; ++t) {
      if (med[first_openblas + t] < res.t_sgemm) {
        res.t_sgemm = med[first_openblas + t];
        res.sgemm_threads = t;
      }
    }
    for (size_t i = first_memcpy; i < first_read; ++i) {
      // Counted as bytes read plus bytes written per second (twice the bytes copied).
      res.memcpy_bps = std::max(res.memcpy_bps, 2.0 * kMemcpyBytes / med[i]);
    }
    if (m <= kStreamingRows) {
      for (size_t i = first_read; i + 2 < med.size(); ++i) {
        res.read_bps = std::max(res.read_bps, weight_bytes_fp32 / med[i]);
      }
      res.fma_flops = fma_peak.flops(kernel_threads) / med[med.size() - 2];
      res.plain_bf16_bps = plain_read.bytes() / med.back();
    }
    for (size_t i = 0; i < res.forms.size(); ++i) res.forms[i].t = med[first_form + i];
    form_diffs_all.push_back(std::move(form_diffs));
    results.push_back(res);
  }
  openblas_set_num_threads(threads);

  const double flops_per_row = 6.0 * hidden * ffn;
  auto gflops = [&](const Result& res, double t) {
    return flops_per_row * res.rows * num_experts / t / 1e9;
  };
  std::printf(
      "\nFP32 weights and activations. (a) = OpenBLAS sgemm alone on contiguous inputs (gate+up "
      "as one [rows x 2F x H] GEMM and down [rows x H x F] per expert), best thread count; "
      "(b) = the whole FFN through OpenBLAS (row gather, gate, up, C++ SwiGLU loop, down) on "
      "%d threads.\n\n",
      threads);
  std::printf(
      "| rows/expert | epserve ms | epserve GFLOP/s | (a) sgemm ms | (a) GFLOP/s | (a) threads | "
      "epserve / (a) | (b) composite GFLOP/s | epserve / (b) | max rel diff vs (b) |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Result& res : results) {
    std::printf("| %lld | %.3f | %.1f | %.3f | %.1f | %d | %.2f | %.1f | %.2f | %.1e |\n",
                static_cast<long long>(res.rows), res.t_fp32 * 1e3, gflops(res, res.t_fp32),
                res.t_sgemm * 1e3, gflops(res, res.t_sgemm), res.sgemm_threads,
                res.t_sgemm / res.t_fp32, gflops(res, res.t_composite),
                res.t_composite / res.t_fp32, res.diff_fp32);
  }
  std::printf(
      "\nBF16 weights (FP32 activations; last columns also BF16 activations), FP32 sums. "
      "Routed rows/s = rows/expert x %d experts / median time.\n\n",
      num_experts);
  std::printf(
      "| rows/expert | bf16-w ms | bf16-w GFLOP/s | bf16-w / (a) | fp32 routed rows/s | bf16-w "
      "routed rows/s | bf16-w / fp32 | max rel diff vs (b) | bf16-w+x ms | bf16-w+x GFLOP/s | "
      "max rel diff vs (b) |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Result& res : results) {
    const double routed = static_cast<double>(res.rows * num_experts);
    std::printf("| %lld | %.3f | %.1f | %.2f | %.0f | %.0f | %.2f | %.1e | %.3f | %.1f | %.1e |\n",
                static_cast<long long>(res.rows), res.t_bf16 * 1e3, gflops(res, res.t_bf16),
                res.t_sgemm / res.t_bf16, routed / res.t_fp32, routed / res.t_bf16,
                res.t_fp32 / res.t_bf16, res.diff_bf16, res.t_bf16_x * 1e3,
                gflops(res, res.t_bf16_x), res.diff_bf16_x);
  }
  std::printf(
      "\nEvery form of the kernels the runtime could pick per row count (kernels/ffn_blocking.h), "
      "on the weights of each layout (BF16: the %s runtime's, and a second runtime's in the "
      "other layout where the pair-panel kernels run), timed in the same round-robin; * = the "
      "form the runtime's plan picks for the row count; weight GB/s = the weights' bytes per "
      "call / median time. A call's time also depends on the call before it in the order, "
      "even with the cache emptied between them (up to 30%% at 8 rows on the 2-core Zen 5 "
      "host): compare the forms with each other here, and the plan's forms with the tables "
      "above.\n\n",
      FfnKernelsName(r, *w16));
  std::printf(
      "| rows/expert | weights | layout | form | ms | weight GB/s | best of its weights / this | "
      "max rel diff vs (b) |\n");
  std::printf("|---:|---|---|---|---:|---:|---:|---:|\n");
  for (size_t k = 0; k < results.size(); ++k) {
    const Result& res = results[k];
    for (size_t i = 0; i < res.forms.size(); ++i) {
      const FormRun& f = res.forms[i];
      double best = f.t;
      for (const FormRun& g : res.forms) {
        if (g.w->dtype == f.w->dtype) best = std::min(best, g.t);
      }
      const double bytes = f.w->dtype == ElementType::kBf16 ? weight_bytes_bf16 : weight_bytes_fp32;
      std::printf(
          "| %lld | %s | %s | %s%s | %.3f | %.1f | %.2f | %.1e |\n",
          static_cast<long long>(res.rows), std::string(common::FlagName(f.w->dtype)).c_str(),
          f.w->blocking.dot ? "pair panels" : "fma panels", f.form.ToString().c_str(),
          f.chosen ? " *" : "", f.t * 1e3, bytes / f.t / 1e9, best / f.t, form_diffs_all[k][i]);
    }
  }
  std::printf(
      "\nWeight streaming at few rows: the experts' weights (%.0f MiB FP32, %.0f MiB BF16) "
      "read once per FFN call / its median time, against memcpy (the best of 1, 2, 4, ... "
      "--threads threads over 512 MiB, bytes read + bytes written per second = 2x the bytes "
      "copied), timed round-robin with the kernels; and against the read floor: a plain "
      "read-only stream of the FP32 weights' bytes (the best of the same thread counts), what a "
      "kernel that only reads them could reach at best on this machine; and against a plain "
      "read of the BF16 weights' bytes (%.0f MiB in huge pages, 64-byte vector loads, four "
      "sums) on the kernels' %d threads. BF16 / FP32 = routed rows/s of BF16 weights over "
      "FP32's.\n\n",
      weight_bytes_fp32 / (1 << 20), weight_bytes_bf16 / (1 << 20),
      plain_read.bytes() / double(1 << 20), kernel_threads);
  std::printf(
      "| rows/expert | memcpy GB/s | read floor GB/s | plain read bf16 GB/s | fp32 weight GB/s | "
      "fp32 / memcpy | fp32 / read | bf16 weight GB/s | bf16 / memcpy | bf16 / read | "
      "bf16 / plain read | bf16 / fp32 | (a) sgemm weight GB/s | (a) / memcpy |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Result& res : results) {
    if (res.memcpy_bps == 0) continue;
    const double fp32_bw = weight_bytes_fp32 / res.t_fp32;
    const double bf16_bw = weight_bytes_bf16 / res.t_bf16;
    const double sgemm_bw = weight_bytes_fp32 / res.t_sgemm;
    std::printf(
        "| %lld | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.1f | %.2f | %.2f | %.2f | %.2f | "
        "%.1f | %.2f |\n",
        static_cast<long long>(res.rows), res.memcpy_bps / 1e9, res.read_bps / 1e9,
        res.plain_bf16_bps / 1e9, fp32_bw / 1e9, fp32_bw / res.memcpy_bps, fp32_bw / res.read_bps,
        bf16_bw / 1e9, bf16_bw / res.memcpy_bps, bf16_bw / res.read_bps,
        bf16_bw / res.plain_bf16_bps, res.t_fp32 / res.t_bf16, sgemm_bw / 1e9,
        sgemm_bw / res.memcpy_bps);
  }
  if (fma_peak.lanes() > 0) {
    std::printf(
        "\nThe compute side of the few-row bound: the FP32 FMA peak of %d-lane vectors on the "
        "kernels' %d threads (twelve independent chains each), timed in the same round-robin. "
        "A form that multiplies m rows by each weight with FP32 FMAs does 2m flops per weight, "
        "so it consumes at most peak / m bytes of BF16 weights a second (2 peak / m of FP32); "
        "its bound is the lesser of that and the plain read (the read floor for FP32). The "
        "BF16 dot-product and AMX forms make two or more products an instruction: the FMA "
        "bound is not theirs.\n\n",
        fma_peak.lanes(), kernel_threads);
    std::printf(
        "| rows/expert | FMA peak GFLOP/s | fp32 on FMAs at most GB/s | fp32 bound GB/s | fp32 "
        "weight GB/s | fp32 / bound | bf16 on FMAs at most GB/s | bf16 bound GB/s | bf16 weight "
        "GB/s | bf16 / bound |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const Result& res : results) {
      if (res.fma_flops == 0) continue;
      const double m = static_cast<double>(res.rows);
      const double fp32_fma = 2.0 * res.fma_flops / m, bf16_fma = res.fma_flops / m;
      const double fp32_bound = std::min(fp32_fma, res.read_bps);
      const double bf16_bound = std::min(bf16_fma, res.plain_bf16_bps);
      const double fp32_bw = weight_bytes_fp32 / res.t_fp32;
      const double bf16_bw = weight_bytes_bf16 / res.t_bf16;
      std::printf("| %lld | %.0f | %.1f | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f | %.2f |\n",
                  static_cast<long long>(res.rows), res.fma_flops / 1e9, fp32_fma / 1e9,
                  fp32_bound / 1e9, fp32_bw / 1e9, fp32_bw / fp32_bound, bf16_fma / 1e9,
                  bf16_bound / 1e9, bf16_bw / 1e9, bf16_bw / bf16_bound);
    }
  }
  std::printf("\nGFLOP/s count 6*H*F flops per routed row (gate, up, down).\n");
  idle_threads.PrintWarningIfAny();
  bench::PrintLoadAverage("after");
  return 0;
}

}  // namespace
}  // namespace epserve::kernels

int main(int argc, char** argv) {
  epserve::bench::ReexecWithoutCoretype(argv);
  epserve::bench::ReexecForUnknownCpu(argv, openblas_get_corename());
  return epserve::kernels::Run(argc, argv);
}
