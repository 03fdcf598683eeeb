// Whether Hopper's wgmma can be reached from NVIDIA's OpenCL (issue 41). NVIDIA's OpenCL
// compiler writes PTX for `.target sm_90`, where ptxas refuses wgmma, and takes no option for
// sm_90a. This probe builds an OpenCL C kernel whose wgmma instructions sit in inline-assembly
// comments (the compiler still fills in the operand registers), takes the program's PTX
// (CL_PROGRAM_BINARIES), uncomments them, sets `.target sm_90a`, loads the result with
// clCreateProgramWithBinary and runs one wgmma.mma_async m64n8k16 (BF16, FP32 sums; A from
// registers, B from local memory through a no-swizzle descriptor) against a host reference.
//
//   probe_wgmma [--ptx=FILE]   exit 0: wgmma ran and matched; 1: it did not; 77: no NVIDIA GPU
//
// On an H100 (driver 580.159.04) it ran and matched exactly (2026-11-28).
#include <CL/cl.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/detail/ptx_patch.h"

namespace {

// "// @W@ " (kernels/detail/ptx_patch.h's mark) hides an instruction from the sm_90 pass.
constexpr char kSource[] = R"CL(
#define W(x) "// @W@ " x
__kernel void wgmma_probe(__global float* out, __global const ushort* a,
                          __global const ushort* b) {
  __local ushort sb[128] __attribute__((aligned(128)));
  const int t = get_local_id(0);
  // B, 8 columns n x 16 k, as two 8 x 8 core matrices (k 0-7, then k 8-15), rows of 16 bytes.
  { const int n = t / 16, k = t % 16; sb[(k / 8) * 64 + n * 8 + k % 8] = b[n * 16 + k]; }
  barrier(CLK_LOCAL_MEM_FENCE);
  __asm__ __volatile__("fence.proxy.async.shared::cta;" ::: "memory");
  barrier(CLK_LOCAL_MEM_FENCE);
  const int w = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
  const int r0 = 16 * w + g, r1 = r0 + 8;
#define PAIR(r, c) ((uint)a[(r) * 16 + (c)] | ((uint)a[(r) * 16 + (c) + 1] << 16))
  const uint a0 = PAIR(r0, 2 * q), a1 = PAIR(r1, 2 * q), a2 = PAIR(r0, 2 * q + 8),
             a3 = PAIR(r1, 2 * q + 8);
  const ulong addr = (ulong)(uint)(size_t)sb;
  // start >> 4, leading (k) byte offset 128 >> 4, stride (n) byte offset 256 >> 4, no swizzle
  const ulong desc = ((addr >> 4) & 0x3fff) | ((ulong)(128 >> 4) << 16) |
                     ((ulong)(256 >> 4) << 32);
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  __asm__ __volatile__(W("wgmma.fence.sync.aligned;") ::: "memory");
  __asm__ __volatile__(W("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 0, 1, 1, 0;")
                       : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                       : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  __asm__ __volatile__(W("wgmma.commit_group.sync.aligned;") ::: "memory");
  __asm__ __volatile__(W("wgmma.wait_group.sync.aligned 0;") ::: "memory");
  out[r0 * 8 + 2 * q] = d0;
  out[r0 * 8 + 2 * q + 1] = d1;
  out[r1 * 8 + 2 * q] = d2;
  out[r1 * 8 + 2 * q + 1] = d3;
}
)CL";

std::string BuildLog(cl_program p, cl_device_id dev) {
  size_t n = 0;
  clGetProgramBuildInfo(p, dev, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
  std::string s(n, '\0');
  clGetProgramBuildInfo(p, dev, CL_PROGRAM_BUILD_LOG, n, s.data(), nullptr);
  return s;
}

float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

int Fail(const char* what, cl_int err) {
  std::printf("{\"wgmma\":false,\"failed\":\"%s\",\"cl_error\":%d}\n", what, err);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* ptx_out = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ptx=", 6) == 0) ptx_out = argv[i] + 6;
  }
  cl_platform_id platforms[8];
  cl_uint num_platforms = 0;
  clGetPlatformIDs(8, platforms, &num_platforms);
  cl_device_id dev = nullptr;
  for (cl_uint i = 0; i < num_platforms && dev == nullptr; ++i) {
    char vendor[256] = {};
    clGetPlatformInfo(platforms[i], CL_PLATFORM_VENDOR, sizeof(vendor), vendor, nullptr);
    if (std::strstr(vendor, "NVIDIA") == nullptr) continue;
    if (clGetDeviceIDs(platforms[i], CL_DEVICE_TYPE_GPU, 1, &dev, nullptr) != CL_SUCCESS) {
      dev = nullptr;
    }
  }
  if (dev == nullptr) {
    std::fprintf(stderr, "no NVIDIA OpenCL GPU\n");
    return 77;
  }
  cl_int err = CL_SUCCESS;
  cl_context ctx = clCreateContext(nullptr, 1, &dev, nullptr, nullptr, &err);
  if (err != CL_SUCCESS) return Fail("clCreateContext", err);
  cl_command_queue queue = clCreateCommandQueue(ctx, dev, 0, &err);
  if (err != CL_SUCCESS) return Fail("clCreateCommandQueue", err);

  // 1. The compiler's PTX for sm_90, wgmma hidden in comments.
  const char* src = kSource;
  cl_program first = clCreateProgramWithSource(ctx, 1, &src, nullptr, &err);
  if (err != CL_SUCCESS) return Fail("clCreateProgramWithSource", err);
  if ((err = clBuildProgram(first, 1, &dev, "-cl-std=CL1.2", nullptr, nullptr)) != CL_SUCCESS) {
    std::fprintf(stderr, "%s\n", BuildLog(first, dev).c_str());
    return Fail("clBuildProgram (source)", err);
  }
  size_t size = 0;
  clGetProgramInfo(first, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr);
  std::string ptx(size, '\0');
  unsigned char* ptx_data = reinterpret_cast<unsigned char*>(ptx.data());
  clGetProgramInfo(first, CL_PROGRAM_BINARIES, sizeof(ptx_data), &ptx_data, nullptr);
  clReleaseProgram(first);
  while (!ptx.empty() && ptx.back() == '\0') ptx.pop_back();

  // 2. Uncommented, for sm_90a (as the runtime does it for the tensor-core FFN).
  int marks = 0;
  absl::StatusOr<std::string> patched = epserve::kernels::detail::PtxForSm90a(ptx, &marks);
  if (!patched.ok() || marks != 4) {
    std::printf("{\"wgmma\":false,\"failed\":\"PTX not as expected (%d marks: %s)\"}\n", marks,
                std::string(patched.status().message()).c_str());
    return 1;
  }
  ptx = *std::move(patched);
  if (ptx_out != nullptr) {
    if (FILE* f = std::fopen(ptx_out, "w")) {
      std::fwrite(ptx.data(), 1, ptx.size(), f);
      std::fclose(f);
    }
  }
  const unsigned char* bin = reinterpret_cast<const unsigned char*>(ptx.c_str());
  const size_t bin_size = ptx.size() + 1;
  cl_int status = CL_SUCCESS;
  cl_program program = clCreateProgramWithBinary(ctx, 1, &dev, &bin_size, &bin, &status, &err);
  if (err != CL_SUCCESS) return Fail("clCreateProgramWithBinary", err);
  if ((err = clBuildProgram(program, 1, &dev, "", nullptr, nullptr)) != CL_SUCCESS) {
    std::fprintf(stderr, "%s\n", BuildLog(program, dev).c_str());
    return Fail("clBuildProgram (sm_90a PTX)", err);
  }
  cl_kernel kernel = clCreateKernel(program, "wgmma_probe", &err);
  if (err != CL_SUCCESS) return Fail("clCreateKernel", err);

  // 3. One m64n8k16 against the host: out[64 x 8] = A[64 x 16] . B[8 x 16]^T.
  std::vector<uint16_t> a(64 * 16), b(8 * 16);
  uint32_t seed = 12345;
  auto next = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<int>((seed >> 16) % 17) - 8;
  };
  auto to_bf16 = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);  // exact: multiples of 1/8 of magnitude <= 1
  };
  for (uint16_t& v : a) v = to_bf16(static_cast<float>(next()) / 8.0f);
  for (uint16_t& v : b) v = to_bf16(static_cast<float>(next()) / 8.0f);
  std::vector<float> out(64 * 8, -999.0f);
  cl_mem da = clCreateBuffer(ctx, CL_MEM_COPY_HOST_PTR, a.size() * 2, a.data(), &err);
  cl_mem db = clCreateBuffer(ctx, CL_MEM_COPY_HOST_PTR, b.size() * 2, b.data(), &err);
  cl_mem dout = clCreateBuffer(ctx, CL_MEM_COPY_HOST_PTR, out.size() * 4, out.data(), &err);
  clSetKernelArg(kernel, 0, sizeof(cl_mem), &dout);
  clSetKernelArg(kernel, 1, sizeof(cl_mem), &da);
  clSetKernelArg(kernel, 2, sizeof(cl_mem), &db);
  const size_t global = 128, local = 128;  // one warpgroup
  err = clEnqueueNDRangeKernel(queue, kernel, 1, nullptr, &global, &local, 0, nullptr, nullptr);
  if (err != CL_SUCCESS) return Fail("clEnqueueNDRangeKernel", err);
  err =
      clEnqueueReadBuffer(queue, dout, CL_TRUE, 0, out.size() * 4, out.data(), 0, nullptr, nullptr);
  if (err != CL_SUCCESS) return Fail("clEnqueueReadBuffer (the kernel)", err);
  double max_error = 0.0;
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 8; ++c) {
      double sum = 0.0;
      for (int k = 0; k < 16; ++k) sum += Bf16ToFloat(a[r * 16 + k]) * Bf16ToFloat(b[c * 16 + k]);
      max_error = std::fmax(max_error, std::fabs(sum - out[r * 8 + c]));
    }
  }
  const bool ok = max_error == 0.0;
  std::printf("{\"wgmma\":%s,\"max_abs_error\":%g}\n", ok ? "true" : "false", max_error);
  clReleaseMemObject(da);
  clReleaseMemObject(db);
  clReleaseMemObject(dout);
  clReleaseKernel(kernel);
  clReleaseProgram(program);
  clReleaseCommandQueue(queue);
  clReleaseContext(ctx);
  return ok ? 0 : 1;
}
