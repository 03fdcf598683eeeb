// Probe for Intel AMX tiles in OpenCL kernels on a CPU device (PoCL): the BF16 weights'
// way to 1.7x FP32 from 128 rows per expert on CPUs whose BF16 dot products (vdpbf16ps) run
// no faster than two FP32 FMAs (Sapphire Rapids, bench/kernels/RESULTS.md run 9). OpenCL C has
// no AMX types, so the kernels spell the instructions out (inline assembly: ldtilecfg,
// tileloadd, tdpbf16ps, tilestored); the process must first ask Linux for the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), which PoCL's threads then share.
//
//   probe_amx [--reps=2000000] [--threads=0] [--build-only]
//
// Steps, each printed: whether the process may run tiles (the CPU's AMX-TILE / AMX-BF16 bits
// and the permission: kernels::detail::HostGrantsAmxTiles, as the runtime asks),
// whether the device's compiler builds the tile kernels (its build log if not), one
// 16x16 tile product against the same sums on the host (small integers: exact in BF16 and
// FP32), then the throughput of tdpbf16ps on four independent accumulator tiles per
// work-item, beside an FP32-FMA kernel (eight independent float16 accumulators a work-item)
// in the same run: GFLOP/s each on --threads work-items (0: the device's compute units).
// --build-only stops after building the kernels, on any CPU (the compiler check alone).
// Exit 0 when the tile product matched, 1 when it did not or a step failed, 77 where the CPU
// or the kernel has no AMX.
#include <CL/cl.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/flags.h"
#include "common/half.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/device.h"
#include "kernels/detail/launch.h"
#include "kernels/runtime.h"

namespace epserve {
namespace {

constexpr char kSource[] = R"CL(
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
// Tiles 0-5: 16 rows of 64 bytes (16 FP32 sums, 16 BF16 pairs).
inline void TileConfig(__private uchar* cfg) {
  for (int i = 0; i < 64; ++i) cfg[i] = 0;
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 6; ++t) {
    cfg[16 + 2 * t] = 64;  // bytes per row
    cfg[48 + t] = 16;      // rows
  }
}
// c[16][16] = reps x (a[16 rows][16 pairs] . b[16 pairs][16 columns of pairs]).
AMX_TARGET void TileProduct(const __private uchar* cfg, ulong a, ulong b, ulong c, int reps) {
  __asm__ volatile("ldtilecfg (%0)" ::"r"((ulong)cfg) : "memory");
  __asm__ volatile("tilezero %%tmm0" ::: "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"(a), "r"((ulong)64) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm3" ::"r"(b), "r"((ulong)64) : "memory");
  for (int i = 0; i < reps; ++i) __asm__ volatile("tdpbf16ps %%tmm3, %%tmm2, %%tmm0" ::: "memory");
  __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(c), "r"((ulong)64) : "memory");
  __asm__ volatile("tilerelease" ::: "memory");
}
// Four independent accumulators (tiles 0, 1, 4, 5), each reps products.
AMX_TARGET void TileThroughput(const __private uchar* cfg, ulong a, ulong b, ulong c, int reps) {
  __asm__ volatile("ldtilecfg (%0)" ::"r"((ulong)cfg) : "memory");
  __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm4\n\ttilezero %%tmm5" :::
                       "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"(a), "r"((ulong)64) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm3" ::"r"(b), "r"((ulong)64) : "memory");
  for (int i = 0; i < reps; ++i) {
    __asm__ volatile(
        "tdpbf16ps %%tmm3, %%tmm2, %%tmm0\n\ttdpbf16ps %%tmm3, %%tmm2, %%tmm1\n\t"
        "tdpbf16ps %%tmm3, %%tmm2, %%tmm4\n\ttdpbf16ps %%tmm3, %%tmm2, %%tmm5" ::: "memory");
  }
  __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"(c), "r"((ulong)64) : "memory");
  __asm__ volatile("tilerelease" ::: "memory");
}
__kernel void tile_product(__global const uint* a, __global const uint* b, __global float* c,
                           int reps) {
  __private uchar cfg[64] __attribute__((aligned(64)));
  TileConfig(cfg);
  TileProduct(cfg, (ulong)a, (ulong)b, (ulong)(c + 256 * get_global_id(0)), reps);
}
__kernel void tile_throughput(__global const uint* a, __global const uint* b, __global float* c,
                              int reps) {
  __private uchar cfg[64] __attribute__((aligned(64)));
  TileConfig(cfg);
  TileThroughput(cfg, (ulong)a, (ulong)b, (ulong)(c + 256 * get_global_id(0)), reps);
}
__kernel void fma_throughput(__global const float16* in, __global float16* out, int reps) {
  float16 a0 = in[0], a1 = in[1], a2 = in[2], a3 = in[3], a4 = in[4], a5 = in[5], a6 = in[6],
          a7 = in[7];
  const float16 m = in[8], s = in[9];
  for (int i = 0; i < reps; ++i) {
    a0 = fma(a0, m, s); a1 = fma(a1, m, s); a2 = fma(a2, m, s); a3 = fma(a3, m, s);
    a4 = fma(a4, m, s); a5 = fma(a5, m, s); a6 = fma(a6, m, s); a7 = fma(a7, m, s);
  }
  out[get_global_id(0)] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
)CL";

// Exits the probe with `code` and the message where `s` is not OK.
#define CHECK_OK(expr, code)                                             \
  do {                                                                   \
    const absl::Status s_ = (expr);                                      \
    if (!s_.ok()) {                                                      \
      std::printf("%s: %s\n", #expr, std::string(s_.message()).c_str()); \
      return code;                                                       \
    }                                                                    \
  } while (0)

// Runs `kernel` on `n` work-items of one (after a warm-up run); seconds of the timed run.
absl::StatusOr<double> TimeKernel(kernels::Runtime& rt, cl_kernel kernel, size_t n) {
  const size_t one = 1;
  double seconds = 0;
  for (int run = 0; run < 2; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    CL_CHECK(clEnqueueNDRangeKernel(rt.queue(), kernel, 1, nullptr, &n, &one, 0, nullptr, nullptr));
    EPSERVE_RETURN_IF_ERROR(rt.Finish());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return seconds;
}

int Run(int reps, int threads, bool build_only) {
  std::string why;
  const bool amx = kernels::detail::HostGrantsAmxTiles(&why);
  std::printf("AMX tiles for this process: %s\n",
              amx ? "granted (cpuid amx-bf16 and amx-tile, arch_prctl)" : why.c_str());
  if (!build_only && !amx) return 77;
  kernels::RuntimeOptions options;
  options.device = "cpu";
  absl::StatusOr<std::unique_ptr<kernels::Runtime>> created = kernels::Runtime::Create(options);
  CHECK_OK(created.status(), 1);
  kernels::Runtime& rt = **created;
  const kernels::DeviceInfo& info = rt.device_info();
  if (threads <= 0) threads = info.compute_units;
  std::printf("device: %s; %d work-items\n", info.Describe().c_str(), threads);
  cl_int err = CL_SUCCESS;
  const char* src = kSource;
  cl_program prog = clCreateProgramWithSource(rt.context(), 1, &src, nullptr, &err);
  if (err != CL_SUCCESS) return 1;
  const cl_device_id device = rt.device();
  if (clBuildProgram(prog, 1, &device, "-cl-std=CL1.2", nullptr, nullptr) != CL_SUCCESS) {
    std::printf("the tile kernels do not build:\n%s\n",
                kernels::detail::BuildLog(prog, device).c_str());
    return 77;
  }
  std::printf("the tile kernels build\n");
  if (build_only) return 0;

  // a: 16 rows x 16 pairs, b: 16 pairs x 16 columns (each a pair): small integers.
  std::vector<uint32_t> a(256), b(256);
  std::vector<float> av(512), bv(512);
  for (int i = 0; i < 512; ++i) {
    av[i] = static_cast<float>((i * 7) % 5 - 2);
    bv[i] = static_cast<float>((i * 3) % 7 - 3);
  }
  auto pack = [](float lo, float hi) {
    return static_cast<uint32_t>(common::FloatToBf16(lo)) |
           (static_cast<uint32_t>(common::FloatToBf16(hi)) << 16);
  };
  for (int i = 0; i < 256; ++i) {
    a[i] = pack(av[2 * i], av[2 * i + 1]);
    b[i] = pack(bv[2 * i], bv[2 * i + 1]);
  }
  std::vector<float> want(256, 0.0f);
  for (int m = 0; m < 16; ++m) {
    for (int n = 0; n < 16; ++n) {
      for (int k = 0; k < 16; ++k) {
        // a[m][k] = pair k of row m; b[k][n] = pair of column n in pair-row k.
        want[m * 16 + n] += av[2 * (m * 16 + k)] * bv[2 * (k * 16 + n)] +
                            av[2 * (m * 16 + k) + 1] * bv[2 * (k * 16 + n) + 1];
      }
    }
  }
  absl::StatusOr<kernels::Buffer> da = rt.AllocateCopy(a.data(), 1024);
  absl::StatusOr<kernels::Buffer> db = rt.AllocateCopy(b.data(), 1024);
  std::vector<float> got(256 * static_cast<size_t>(threads), -12345.0f);  // poisoned
  absl::StatusOr<kernels::Buffer> dc = rt.AllocateCopy(got.data(), got.size() * sizeof(float));
  for (const auto* buffer : {&da, &db, &dc}) CHECK_OK(buffer->status(), 1);
  cl_int errs[3] = {CL_SUCCESS, CL_SUCCESS, CL_SUCCESS};
  cl_kernel product = clCreateKernel(prog, "tile_product", &errs[0]);
  cl_kernel tiles = clCreateKernel(prog, "tile_throughput", &errs[1]);
  cl_kernel fma = clCreateKernel(prog, "fma_throughput", &errs[2]);
  for (cl_int e : errs) {
    if (e != CL_SUCCESS) return 1;
  }
  CHECK_OK(kernels::detail::SetArgs(product, *da, *db, *dc, cl_int{1}), 1);
  CHECK_OK(TimeKernel(rt, product, 1).status(), 1);
  CHECK_OK(rt.Read(*dc, 0, got.data(), 1024), 1);
  int wrong = 0;
  for (int i = 0; i < 256; ++i) wrong += got[i] != want[i];
  std::printf(
      "one tile product against the host: %s (%d of 256 sums differ; c[0][0] %.1f, "
      "want %.1f)\n",
      wrong == 0 ? "match" : "MISMATCH", wrong, got[0], want[0]);

  CHECK_OK(kernels::detail::SetArgs(tiles, *da, *db, *dc, cl_int{reps}), 1);
  const absl::StatusOr<double> tile_s = TimeKernel(rt, tiles, static_cast<size_t>(threads));
  CHECK_OK(tile_s.status(), 1);
  // Each tdpbf16ps: 16 x 16 sums of 16 pairs = 16 x 16 x 32 multiply-adds.
  const double tile_flops = 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(reps) * threads;

  std::vector<float> fin(16 * 10, 1.0f);
  for (int i = 128; i < 144; ++i) fin[i] = 0.999f;  // m
  for (int i = 144; i < 160; ++i) fin[i] = 0.001f;  // s
  absl::StatusOr<kernels::Buffer> dfin = rt.AllocateCopy(fin.data(), fin.size() * sizeof(float));
  absl::StatusOr<kernels::Buffer> dfout = rt.Allocate(64 * static_cast<size_t>(threads));
  for (const auto* buffer : {&dfin, &dfout}) CHECK_OK(buffer->status(), 1);
  // An iteration of the FMA loop is 8 x 16 multiply-adds, one of the tile loop 4 x 8192: the
  // FMA loop runs 16x as many iterations, for a time of the same order.
  const int fma_reps = reps * 16;
  CHECK_OK(kernels::detail::SetArgs(fma, *dfin, *dfout, cl_int{fma_reps}), 1);
  const absl::StatusOr<double> fma_s = TimeKernel(rt, fma, static_cast<size_t>(threads));
  CHECK_OK(fma_s.status(), 1);
  const double fma_flops = 2.0 * 16 * 8 * static_cast<double>(fma_reps) * threads;
  std::printf(
      "tdpbf16ps: %.1f GFLOP/s (%.3f s); FP32 FMA (float16): %.1f GFLOP/s (%.3f s); "
      "tiles / fma %.2fx, %d work-items\n",
      tile_flops / *tile_s / 1e9, *tile_s, fma_flops / *fma_s / 1e9, *fma_s,
      (tile_flops / *tile_s) / (fma_flops / *fma_s), threads);
  for (cl_kernel k : {product, tiles, fma}) clReleaseKernel(k);
  clReleaseProgram(prog);
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace epserve

int main(int argc, char** argv) {
  int reps = 2000000, threads = 0;
  bool build_only = false;
  epserve::common::FlagSet fs("probe_amx", "AMX tiles in OpenCL kernels on a CPU device (PoCL).");
  fs.Add("reps", &reps, "tile products per accumulator and work-item in the throughput step");
  fs.Add("threads", &threads, "work-items (0: the device's compute units)");
  fs.Add("build-only", &build_only, "stop after building the kernels (any CPU)");
  if (absl::Status s = fs.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  return epserve::Run(reps, threads, build_only);
}
