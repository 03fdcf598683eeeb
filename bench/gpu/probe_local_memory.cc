// How much local memory one work-group may use on this OpenCL device (issue 41). NVIDIA's
// OpenCL reports CL_DEVICE_LOCAL_MEM_SIZE 48 KiB, the tensor-core FFN's tiles are sized to it
// (kernels/cl/expert_ffn_mma.cl: three 16 KiB stages), while a Hopper multiprocessor holds
// 228 KiB and CUDA kernels may use up to 227 KiB a block once they ask. Local memory that a
// kernel declares is fixed at build time; local memory passed as a kernel argument
// (clSetKernelArg with a size and no value) is the launch's dynamic shared memory. This probe
// launches one kernel with a __local argument of each size below and checks what it wrote
// and read back, so that it says which sizes the driver accepts, refuses (and with which
// error) or runs wrong.
//
//   probe_local_memory [--device=gpu|cpu]   exit 0: every size answered (see the lines);
//                                           77: no such device
//
// One line of JSON per size: {"local_bytes":B,"set_arg":E,"enqueue":E,"finish":E,
// "kernel_local_bytes":B,"ok":true|false}, E an OpenCL error code (0: CL_SUCCESS), and first
// {"device":"...","device_local_mem":B,"nv_extensions":"..."}.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/detail/device.h"

namespace {

// Every work-item writes its share of the words, then sums words other work-items wrote.
constexpr char kSource[] = R"CL(
__kernel void touch_local(__global uint* out, __local uint* lds, uint words) {
  const uint t = get_local_id(0), n = get_local_size(0);
  for (uint i = t; i < words; i += n) lds[i] = i * 2654435761u + get_group_id(0);
  barrier(CLK_LOCAL_MEM_FENCE);
  uint sum = 0;
  for (uint i = (t + 1) % n; i < words; i += n) sum += lds[words - 1 - i];
  out[get_group_id(0) * n + t] = sum;
}
)CL";

constexpr size_t kItems = 128;  // a work-group
constexpr size_t kGroups = 4;

// What touch_local writes for work-item t of group g.
uint32_t Expected(uint32_t words, uint32_t g, uint32_t t) {
  uint32_t sum = 0;
  for (uint32_t i = (t + 1) % kItems; i < words; i += kItems) {
    sum += (words - 1 - i) * 2654435761u + g;
  }
  return sum;
}

// The device's extensions whose names start with cl_nv_, space-separated.
std::string NvExtensions(cl_device_id dev) {
  size_t n = 0;
  clGetDeviceInfo(dev, CL_DEVICE_EXTENSIONS, 0, nullptr, &n);
  std::string all(n, '\0');
  clGetDeviceInfo(dev, CL_DEVICE_EXTENSIONS, n, all.data(), nullptr);
  std::string nv;
  size_t at = 0;
  while ((at = all.find("cl_nv_", at)) != std::string::npos) {
    const size_t end = all.find_first_of(" \0", at);
    nv += (nv.empty() ? "" : " ") + all.substr(at, end - at);
    at = end;
  }
  return nv;
}

// One launch with `bytes` of local memory as the kernel's argument; prints its line.
void TrySize(cl_command_queue queue, cl_device_id dev, cl_kernel kernel, cl_mem out, size_t bytes) {
  const cl_uint words = static_cast<cl_uint>(bytes / sizeof(cl_uint));
  std::vector<cl_uint> poison(kItems * kGroups, 0xDEADBEEFu);
  clEnqueueWriteBuffer(queue, out, CL_TRUE, 0, poison.size() * sizeof(cl_uint), poison.data(), 0,
                       nullptr, nullptr);
  const cl_int set_arg = clSetKernelArg(kernel, 1, bytes, nullptr);
  clSetKernelArg(kernel, 2, sizeof(words), &words);
  cl_ulong kernel_local = 0;
  clGetKernelWorkGroupInfo(kernel, dev, CL_KERNEL_LOCAL_MEM_SIZE, sizeof(kernel_local),
                           &kernel_local, nullptr);
  const size_t global = kItems * kGroups, local = kItems;
  cl_int enqueue = CL_SUCCESS, finish = CL_SUCCESS;
  bool ok = false;
  if (set_arg == CL_SUCCESS) {
    enqueue =
        clEnqueueNDRangeKernel(queue, kernel, 1, nullptr, &global, &local, 0, nullptr, nullptr);
    finish = clFinish(queue);
    if (enqueue == CL_SUCCESS && finish == CL_SUCCESS) {
      std::vector<cl_uint> got(kItems * kGroups, 0);
      clEnqueueReadBuffer(queue, out, CL_TRUE, 0, got.size() * sizeof(cl_uint), got.data(), 0,
                          nullptr, nullptr);
      ok = true;
      for (uint32_t g = 0; g < kGroups && ok; ++g) {
        for (uint32_t t = 0; t < kItems && ok; ++t)
          ok = got[g * kItems + t] == Expected(words, g, t);
      }
    }
  }
  std::printf(
      "{\"local_bytes\":%zu,\"set_arg\":%d,\"enqueue\":%d,\"finish\":%d,"
      "\"kernel_local_bytes\":%llu,\"ok\":%s}\n",
      bytes, set_arg, enqueue, finish, static_cast<unsigned long long>(kernel_local),
      ok ? "true" : "false");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  bool gpu = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device=cpu") == 0) {
      gpu = false;
    } else if (std::strcmp(argv[i], "--device=gpu") != 0) {
      std::fprintf(stderr, "usage: %s [--device=gpu|cpu]\n", argv[0]);
      return 2;
    }
  }
  namespace kd = epserve::kernels::detail;
  absl::StatusOr<std::vector<kd::FoundDevice>> devices = kd::EnumerateDevices();
  absl::StatusOr<kd::FoundDevice> found =
      devices.ok() ? kd::ChooseDevice(*devices, gpu ? "gpu" : "cpu", 0) : devices.status();
  if (!found.ok()) {
    std::fprintf(stderr, "%s\n", std::string(found.status().message()).c_str());
    return 77;
  }
  const cl_device_id dev = found->id;
  const std::string& name = found->info.device_name;
  cl_ulong device_local = 0;
  clGetDeviceInfo(dev, CL_DEVICE_LOCAL_MEM_SIZE, sizeof(device_local), &device_local, nullptr);
  std::printf("{\"device\":\"%s\",\"device_local_mem\":%llu,\"nv_extensions\":\"%s\"}\n",
              name.c_str(), static_cast<unsigned long long>(device_local),
              NvExtensions(dev).c_str());
  cl_int err = CL_SUCCESS;
  cl_context ctx = clCreateContext(nullptr, 1, &dev, nullptr, nullptr, &err);
  if (err != CL_SUCCESS) return 1;
  const char* src = kSource;
  cl_program program = clCreateProgramWithSource(ctx, 1, &src, nullptr, &err);
  if (err != CL_SUCCESS || clBuildProgram(program, 1, &dev, "-cl-std=CL1.2", nullptr, nullptr)) {
    std::fprintf(stderr, "the probe's kernel did not build\n");
    return 1;
  }
  cl_kernel kernel = clCreateKernel(program, "touch_local", &err);
  cl_mem out =
      clCreateBuffer(ctx, CL_MEM_READ_WRITE, kItems * kGroups * sizeof(cl_uint), nullptr, &err);
  clSetKernelArg(kernel, 0, sizeof(cl_mem), &out);
  // Each size on a queue of its own: a refused launch may leave a queue in error.
  for (const size_t kib : {16, 32, 48, 49, 64, 96, 128, 160, 200, 227, 228}) {
    cl_command_queue queue = clCreateCommandQueue(ctx, dev, 0, &err);
    if (err != CL_SUCCESS) return 1;
    TrySize(queue, dev, kernel, out, kib * 1024);
    clReleaseCommandQueue(queue);
  }
  clReleaseMemObject(out);
  clReleaseKernel(kernel);
  clReleaseProgram(program);
  clReleaseContext(ctx);
  return 0;
}
